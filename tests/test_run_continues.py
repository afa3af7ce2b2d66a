"""The starting command continues its own run: the same `python -m project fit --run_dir X ...` re-run after a kill -9
continues bit-identical, after the run finished changes nothing, after a death before the first checkpoint starts
clean, and with another config refuses. The kills are tests/tools/kill_resume.py's, caught from outside while a
checkpoint is written, so the killed process runs exactly the command that is re-run."""

import hashlib
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

spec = importlib.util.spec_from_file_location("kill_resume", REPO / "tests/tools/kill_resume.py")
kill_resume = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kill_resume)


def command(run: Path) -> list[str]:
    return kill_resume.command(run, resume=False)  # `fit --config configs/default.yaml ... --run_dir <run>`


def files(run: Path) -> dict[str, tuple]:
    """Every file of a run directory with its mtime and content hash."""
    return {
        str(p.relative_to(run)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in sorted(run.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """The command's run, undisturbed (in this process: the forks below then need no imports)."""
    run = tmp_path_factory.mktemp("reference") / "run"
    assert run_cli(*command(run)[3:]) == 0
    return run


def kill_while_writing(tmp_path: Path, run: Path, nth_write: int) -> dict:
    fork = torch.get_num_threads() == 1  # tests/conftest.py: one intra-op thread, which a fork keeps
    target = {"mode": "write", "nth_write": nth_write}
    landed = kill_resume.kill_once(command(run), tmp_path, run, target, timeout=150, fork=fork)
    assert landed["landed"] == "write" and landed["tmp_left"], landed
    return landed


@pytest.mark.claim("run-continues-after-kill")
def test_the_same_command_after_a_kill_9_continues_bit_identical(tmp_path, finished):
    run = tmp_path / "run"
    kill_while_writing(tmp_path, run, nth_write=3)  # the third mid-epoch save: two are on disk
    assert kill_resume.progress(run) == {"global_step": 2, "epoch": 0, "position": 2}
    kill_resume.run_to_end(command(run), tmp_path, timeout=150, fork=torch.get_num_threads() == 1)
    assert kill_resume.compare(finished, run) == []
    (record,) = [json.loads(line) for line in (run / "resumes.jsonl").read_text().splitlines()]
    assert record["ckpt_path"] == str(run / "checkpoints/last.ckpt") and record["changes"] == []
    assert "Resuming" in (tmp_path / "last_attempt.log").read_text()


@pytest.mark.claim("run-finished-left-unchanged")
def test_the_same_command_after_the_run_finished_changes_nothing(finished, capsys):
    before = files(finished)
    capsys.readouterr()
    assert run_cli(*command(finished)[3:]) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()
    assert "has finished" in line and "--trainer.max_epochs" in line, line
    assert files(finished) == before


@pytest.mark.claim("run-changed-config-refused")
def test_the_command_with_another_config_refuses_and_changes_nothing(finished, capsys):
    before = files(finished)
    capsys.readouterr()
    assert run_cli(*command(finished)[3:], "--model.init_args.label_smoothing", "0.2") == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "model.init_args.label_smoothing: 0.1 -> 0.2" in err and "make resume ARGS=" in err, err
    assert "--run_dir runs/<new name>" in err and files(finished) == before


@pytest.mark.claim("run-dead-attempt-started-clean")
def test_the_same_command_after_a_death_before_the_first_checkpoint_starts_clean(tmp_path, finished):
    run = tmp_path / "run"
    kill_while_writing(tmp_path, run, nth_write=1)  # dies writing its first checkpoint
    assert not (run / "checkpoints/last.ckpt").exists()
    dead = files(run)
    assert "config.yaml" in dead and any(name.startswith("events.out") for name in dead), dead
    kill_resume.run_to_end(command(run), tmp_path, timeout=150, fork=torch.get_num_threads() == 1)
    after = files(run)
    assert not set(dead.items()) & set(after.items())  # no file of the dead attempt is left as it was
    assert not {name for name in dead if name.startswith("events.out")} & set(after)  # one TensorBoard run
    assert not (run / "resumes.jsonl").exists() and not (run / "metrics.1.csv").exists()
    assert kill_resume.compare(finished, run) == []  # and the new run is the undisturbed one

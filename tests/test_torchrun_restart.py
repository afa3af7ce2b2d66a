"""scripts/torchrun.sh restarts a group whose rank died: a rank SIGKILLed at a forced moment (tests/ddp_probe.py's
KillAt: mid-step, during validation, while rank 0 writes a checkpoint), and the job still exits 0 with no human
step: one node of 2 processes killed at each moment in turn. Each restart continues the run from its last
checkpoint, and the run ends bit-identical to an undisturbed one. CPU processes with gloo. Two agents (`--nnodes 2`,
c10d) restarting together: tests/test_ddp.py's two torchrun nodes, whose rank 0 dies writing a checkpoint."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import QUIET, REPO
from tests.ddp_probe import killing
from tests.ddp_processes import LAUNCH_DEADLINE_S, env_for_children, finish_together, free_port, start

TORCHRUN = REPO / "scripts/torchrun.sh"
FLAGS = "--trainer.max_epochs 2 --trainer.limit_train_batches 4 --trainer.limit_val_batches 2".split()
FLAGS += ["--test_after_fit", "false", *QUIET]
PHASES = ["step", "validation", "checkpoint"]


def torchrun(*args, env: dict) -> subprocess.Popen:
    return start([TORCHRUN, *args], REPO, env)


def weights(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)[
        "state_dict"
    ]


def report(results) -> str:
    return "\n\n".join(f"agent {i}, exit {code}:\n{err[-5000:]}" for i, (code, _, err) in enumerate(results))


@pytest.fixture(scope="module")
def env() -> dict:
    return env_for_children() | {"PY": sys.executable, "OMP_NUM_THREADS": "1"}


@pytest.mark.claim("ddp-torchrun-restarts")
def test_default_is_three_restarts_with_a_c10d_rendezvous(tmp_path):
    echo = tmp_path / "python"
    echo.write_text('#!/usr/bin/env bash\necho "$*"\n')
    echo.chmod(0o755)
    args = [TORCHRUN, "--nnodes", "2", "--node_rank", "1", "--master_addr", "10.0.0.1", "--run_id", "x"]
    out = subprocess.run(
        args, env={**os.environ, "PY": str(echo)}, capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr
    assert "--max_restarts 3 --rdzv_backend c10d --rdzv_endpoint 10.0.0.1:29500 --rdzv_id x" in out.stdout
    assert "--rdzv_conf is_host=0" in out.stdout  # node 0 hosts the rendezvous store


@pytest.fixture(scope="module")
def killed_and_clean(tmp_path_factory, env) -> tuple[Path, list]:
    """One job whose ranks are killed at each of PHASES in turn (3 restarts), and beside it the same job undisturbed."""
    tmp = tmp_path_factory.mktemp("restart")
    procs = [
        torchrun("--nproc_per_node", "2", "--max_restarts", "3", "--master_port", free_port(), "--run_id", "killed",
                 "--", "--run_dir", tmp / "killed", *FLAGS, *killing(tmp / "marker", PHASES), env=env),
        torchrun("--nproc_per_node", "2", "--master_port", free_port(), "--run_id", "clean", "--",
                 "--run_dir", tmp / "clean", *FLAGS, env=env),
    ]  # fmt: skip
    return tmp, finish_together(procs, timeout=2 * LAUNCH_DEADLINE_S - 30)


@pytest.mark.claim("ddp-torchrun-restarts")
@pytest.mark.slow
@pytest.mark.timeout(2 * LAUNCH_DEADLINE_S)
def test_a_rank_killed_mid_step_in_validation_and_mid_checkpoint_restarts_the_group(killed_and_clean):
    tmp, results = killed_and_clean
    assert [code for code, _, _ in results] == [0, 0], report(results)
    assert (tmp / "marker").read_text().split() == PHASES  # each kill hit its phase, one per attempt
    starts = sorted((tmp / "marker.starts").read_text().splitlines())
    assert starts == ["start 0"] * 4 + ["start 1"] * 4, starts  # both ranks: the first start and 3 restarts


@pytest.mark.claim("ddp-torchrun-restarts")
@pytest.mark.slow
@pytest.mark.timeout(2 * LAUNCH_DEADLINE_S)
def test_restarted_run_continues_and_ends_bit_identical_to_an_undisturbed_one(killed_and_clean):
    tmp, results = killed_and_clean
    assert [code for code, _, _ in results] == [0, 0], report(results)
    # Each restart continued the run from its last checkpoint (the starting command's rule), none started over.
    resumes = (tmp / "killed" / "resumes.jsonl").read_text().splitlines()
    assert len(resumes) == len(PHASES), resumes
    a, b = weights(tmp / "killed"), weights(tmp / "clean")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # One logger run: every attempt's TensorBoard events in the one folder an undisturbed run writes to.
    folders = {name: {p.parent.relative_to(tmp / name) for p in (tmp / name).glob("**/events.out.tfevents.*")}
               for name in ("killed", "clean")}  # fmt: skip
    assert len(folders["killed"]) == 1 and folders["killed"] == folders["clean"], folders

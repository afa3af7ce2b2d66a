"""scripts/torchrun.sh restarts a group whose rank died: a rank SIGKILLed at a forced moment (KillAt, below: mid-step,
during validation, while rank 0 writes a checkpoint), and the job still exits 0 with no human step: one node of 2
processes killed at each moment in turn, and two agents (`--nnodes 2`, c10d) killed while rank 0 writes a
checkpoint, where one node's failure restarts the other node's worker too. Each restart continues the run from its
last checkpoint, and the run ends bit-identical to an undisturbed one. CPU processes with gloo."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from tests.conftest import QUIET, REPO
from tests.ddp_processes import LAUNCH_DEADLINE_S, env_for_children, finish_together, free_port, start

TORCHRUN = REPO / "scripts/torchrun.sh"
FLAGS = "--trainer.max_epochs 2 --trainer.limit_train_batches 4 --trainer.limit_val_batches 2".split()
FLAGS += ["--test_after_fit", "false", *QUIET]
PHASES = ["step", "validation", "checkpoint"]


class KillAt(Callback):
    """SIGKILLs a rank at the first of `phases` not yet in the file `marker`, from epoch 1 on (after a checkpoint):
    `step` (rank 1, at the end of batch 1), `validation` (rank 1, at a validation batch's start), `checkpoint`
    (rank 0, the one writer: its checkpoint written into atomic_write's temporary file, not yet renamed). The phase
    goes into `marker` first, so each fires once and the restarted group moves on to the next; each process start
    is a line `start <rank>` in `<marker>.starts`."""

    def __init__(self, marker: str, phases: list[str]) -> None:
        self.marker, self.phases = Path(marker), phases

    def setup(self, trainer, pl_module, stage: str) -> None:
        done = self.marker.read_text().split() if self.marker.exists() else []
        self.due = next((p for p in self.phases if p not in done), None)
        with open(f"{self.marker}.starts", "a") as f:
            f.write(f"start {trainer.global_rank}\n")
        io = trainer.strategy.checkpoint_io
        if self.due == "checkpoint" and trainer.global_rank == 0:
            save = io.save_checkpoint

            def save_and_die(checkpoint, path, storage_options=None):
                if trainer.current_epoch >= 1:
                    real = torch.save

                    def written_then_killed(obj, f, *args, **kwargs):
                        real(obj, f, *args, **kwargs)
                        f.flush()
                        self.kill("checkpoint")

                    torch.save = written_then_killed
                save(checkpoint, path, storage_options)

            io.save_checkpoint = save_and_die

    def kill(self, phase: str) -> None:
        with open(self.marker, "a") as f:
            f.write(f"{phase}\n")
            f.flush()
            os.fsync(f.fileno())
        os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.due == "step" and trainer.global_rank == 1 and trainer.current_epoch >= 1 and batch_idx == 1:
            self.kill("step")

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if self.due == "validation" and trainer.global_rank == 1 and trainer.current_epoch >= 1:
            if not trainer.sanity_checking:
                self.kill("validation")


def killing(marker: Path, phases: list[str]) -> list[str]:
    return ["--trainer.callbacks+=tests.test_torchrun_restart.KillAt", f"--trainer.callbacks.marker={marker}",
            f"--trainer.callbacks.phases=[{','.join(phases)}]"]  # fmt: skip


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


@pytest.mark.claim("ddp-torchrun-restarts")
@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_DEADLINE_S + 30)
def test_two_agents_restart_together_when_rank_0_dies_writing_a_checkpoint(tmp_path, env, killed_and_clean):
    marker, port = tmp_path / "marker", free_port()
    nodes = [
        torchrun("--nnodes", "2", "--nproc_per_node", "1", "--node_rank", rank, "--master_port", port,
                 "--max_restarts", "1", "--run_id", "two", "--", "--run_dir", tmp_path / "two", *FLAGS,
                 *killing(marker, ["checkpoint"]), env=env)
        for rank in (0, 1)
    ]  # fmt: skip
    results = finish_together(nodes)
    assert [code for code, _, _ in results] == [0, 0], report(results)
    assert marker.read_text().split() == ["checkpoint"]
    # Both nodes' workers started twice: the failure on one node restarted the other node's worker too.
    starts = sorted((tmp_path / "marker.starts").read_text().splitlines())
    assert starts == ["start 0", "start 0", "start 1", "start 1"], starts
    # The restarted workers continued the run, which ends as the undisturbed 2-process run on one node does.
    assert len((tmp_path / "two" / "resumes.jsonl").read_text().splitlines()) == 1
    a, b = weights(tmp_path / "two"), weights(killed_and_clean[0] / "clean")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

"""Exact resume: epoch-boundary stop, SIGTERM / Ctrl+C mid-epoch, `--ckpt_path last` in the run's own dir."""

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from tests.conftest import QUIET, read_summary, run_cli

pytestmark = pytest.mark.slow
# 4 epochs x 3 steps, a `last` checkpoint after every step: small enough for CPU, long enough to stop mid-epoch.
FLAGS = [
    *QUIET,
    "--trainer.max_epochs",
    "4",
    "--trainer.limit_train_batches",
    "3",
    "--trainer.limit_val_batches",
    "1",
    "--trainer.limit_test_batches",
    "1",
    "--checkpoint_every_n_steps",
    "1",
]


class StopAfterEpoch(Callback):
    """Stands in for a crash right after the epoch-end checkpoint (ModelCheckpoint saves in on_train_epoch_end)."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.current_epoch == self.epoch:
            raise SystemExit(99)


class SignalAtStep(Callback):
    """Sends a real signal to this process in the middle of a step."""

    def __init__(self, step: int, signum: int = int(signal.SIGTERM)) -> None:
        self.step, self.signum = step, signum

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)


def add(callback: str, **init_args) -> str:
    return "--trainer.callbacks+=" + json.dumps(
        {"class_path": f"tests.test_resume.{callback}", "init_args": init_args}
    )


def weights(run_dir: Path) -> dict:
    return torch.load(Path(run_dir) / "checkpoints/last.ckpt", map_location="cpu", weights_only=True)


def assert_identical(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa["global_step"] == wb["global_step"] == 12
    assert all(torch.equal(wa["state_dict"][k], wb["state_dict"][k]) for k in wa["state_dict"])
    sa, sb = read_summary(a), read_summary(b)
    assert (sa["best_val_acc"], sa["test_acc"]) == (sb["best_val_acc"], sb["test_acc"])


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """One uninterrupted run the resumed runs must match bit for bit."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    assert run_cli("fit", *FLAGS, "--run_dir", run_dir) == 0
    return run_dir


def test_epoch_boundary_resume_is_bit_identical(reference, in_tmp):
    assert run_cli("fit", *FLAGS, "--run_dir", "runs/a", add("StopAfterEpoch", epoch=2)) == 99
    assert weights("runs/a")["epoch"] == 1 and not (in_tmp / "runs/a/summary.json").exists()
    # `--ckpt_path last` finds the most recent run and continues it in place: no new run directory.
    assert run_cli("fit", *FLAGS, "--ckpt_path", "last") == 0
    assert sorted(p.name for p in (in_tmp / "runs").iterdir()) == ["a"]
    assert_identical(reference, in_tmp / "runs/a")
    # Same logger run: TensorBoard appends to the run's folder; the CSV of the first part is kept.
    assert len(list((in_tmp / "runs/a").glob("events.out.tfevents.*"))) >= 2
    assert (in_tmp / "runs/a/metrics.1.csv").exists() and (in_tmp / "runs/a/metrics.csv").exists()


def test_sigterm_mid_epoch_saves_exits_143_and_resumes_identically(reference, in_tmp):
    code = run_cli("fit", *FLAGS, "--run_dir", "runs/t", add("SignalAtStep", step=7))
    assert code == 143
    state = weights("runs/t")
    assert (
        state["global_step"] == 8
        and state["loops"]["fit_loop"]["epoch_progress"]["current"]["completed"] == 2
    )
    (loader_state,) = state["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    # The in-memory loader (digits' default) counts `position`, the DataLoader path `batches`.
    assert loader_state["epoch"] == 2 and loader_state.get("position", loader_state.get("batches")) == 2
    assert run_cli("fit", *FLAGS, "--ckpt_path", "runs/t/checkpoints/last.ckpt") == 0
    assert_identical(reference, in_tmp / "runs/t")


def test_ctrl_c_saves_and_exits_130(in_tmp):
    code = run_cli(
        "fit",
        *FLAGS,
        "--trainer.max_epochs",
        "1",
        "--test_after_fit",
        "false",
        "--run_dir",
        "r",
        add("SignalAtStep", step=1, signum=int(signal.SIGINT)),
    )
    assert code == 130
    assert weights("r")["global_step"] == 2

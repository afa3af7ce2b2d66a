"""Exact resume: epoch-boundary stop, SIGTERM / Ctrl+C mid-epoch, `--ckpt_path last` in the run's own dir;
when `last.ckpt` is written and what it holds."""

import json
import os
import random
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import Callback

from project.callbacks import run_checkpoint
from project.data.loaders import EpochShard
from tests.conftest import read_summary, run_cli

pytestmark = pytest.mark.slow
# 4 epochs x 3 steps, a `last` checkpoint after every step: small enough for CPU, long enough to stop mid-epoch.
# As `make train` runs (progress bar, every callback), only shorter.
FLAGS = [
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
    """Stands in for a crash right after the epoch-end checkpoint (RunCheckpoint saves in on_train_epoch_end), the
    first time only (a file in the working directory marks it): the run's config.yaml records this callback, and the
    resumed run, started from that config, must go on."""

    def __init__(self, epoch: int, marker: str = "stopped-after-epoch") -> None:
        self.epoch, self.marker = epoch, Path(marker)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.current_epoch == self.epoch and not self.marker.exists():
            self.marker.touch()
            raise SystemExit(99)


class SignalAtStep(Callback):
    """Sends a real signal to this process in the middle of a step."""

    def __init__(self, step: int, signum: int = int(signal.SIGTERM)) -> None:
        self.step, self.signum = step, signum

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)


class DoubleCtrlC(Callback):
    """Ctrl+C before this step's backward, and again after it: the step is still running at the second one."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGINT)

    def on_after_backward(self, trainer, pl_module) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGINT)


CLOCK = {"offset": 0.0}  # seconds added to RunCheckpoint's clock (the test patches its `time` module)


class FakeTime:
    def __getattr__(self, name):
        return getattr(time, name)

    @staticmethod
    def monotonic() -> float:
        return time.monotonic() + CLOCK["offset"]


class ClockJump(Callback):
    """29 minutes pass before step 2, two more before step 3; the run stops (exit 99) before step 5."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        CLOCK["offset"] += {1: 29 * 60, 2: 2 * 60}.get(trainer.global_step, 0)
        if trainer.global_step == 4:
            raise SystemExit(99)


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


@pytest.mark.claim("resume-bit-identical", "resume-continues-own-run")
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


@pytest.mark.claim("resume-bit-identical", "stop-signal-saves-and-exits", "checkpoint-holds-full-state")
def test_sigterm_mid_epoch_saves_exits_143_and_resumes_identically(reference, in_tmp):
    code = run_cli("fit", *FLAGS, "--run_dir", "runs/t", add("SignalAtStep", step=7))
    assert code == 143
    state = weights("runs/t")
    assert (
        state["global_step"] == 8
        and state["loops"]["fit_loop"]["epoch_progress"]["current"]["completed"] == 2
    )
    (loader_state,) = state["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert loader_state["epoch"] == 2 and loader_state["position"] == 2
    # The rest of what the README says a checkpoint holds: optimizer (AdamW moments), LR schedule, epoch,
    # and every random stream (CUDA's only where CUDA is in use).
    assert state["epoch"] == 2 and state["optimizer_states"][0]["state"]
    assert state["lr_schedulers"][0]["last_epoch"] == 8  # stepped once per optimizer step
    (rng,) = [v["rng"] for k, v in state["callbacks"].items() if k.startswith("RunCheckpoint")]
    assert {"python", "numpy", "torch"} <= set(rng) and ("cuda" in rng) == torch.cuda.is_initialized()
    assert run_cli("fit", *FLAGS, "--ckpt_path", "runs/t/checkpoints/last.ckpt") == 0
    assert_identical(reference, in_tmp / "runs/t")


@pytest.mark.claim("resume-bit-identical")
def test_mid_epoch_resume_with_loader_workers_and_augmentation_is_bit_identical(in_tmp):
    """The DataLoader path with a worker process and augmentation on: the worker only serves pixels and the
    augmentation is drawn on the device from the batch's place, so a mid-epoch resume repeats the uninterrupted
    run exactly (it did not while workers augmented with their own random streams)."""
    flags = [*FLAGS, "--data.init_args.in_memory", "false", "--data.init_args.num_workers", "1"]
    flags += ["--data.init_args.augment", "affine"]
    assert run_cli("fit", *flags, "--run_dir", "runs/ref") == 0
    assert run_cli("fit", *flags, "--run_dir", "runs/t", add("SignalAtStep", step=7)) == 143
    assert run_cli("fit", *flags, "--ckpt_path", "runs/t/checkpoints/last.ckpt") == 0
    assert_identical(in_tmp / "runs/ref", in_tmp / "runs/t")


@pytest.mark.claim("resume-as-started")
def test_resume_continues_the_run_as_it_was_started(in_tmp, capsys):
    """`--ckpt_path last` and no --config: the run's config.yaml (its epochs, its loggers, its data), not
    configs/default.yaml; any other flag is a change that is printed and recorded."""
    started = [*FLAGS[2:], "--trainer.max_epochs", "3", "--data.init_args.batch_size", "32"]
    csv_only = {
        "class_path": "lightning.pytorch.loggers.CSVLogger",
        "init_args": {"save_dir": "runs", "name": "", "version": ""},  # as configs/default.yaml writes them
    }
    started += ["--trainer.logger", json.dumps([csv_only])]  # CSV only, no TensorBoard
    stop = add("StopAfterEpoch", epoch=1)
    assert run_cli("fit", *started, "--run_dir", "runs/a", stop) == 99
    assert run_cli("fit", "--ckpt_path", "last") == 0  # what `make resume` runs
    out = capsys.readouterr().out
    assert "Resuming runs/a as it was started: its config.yaml (no change)." in out
    summary = read_summary(in_tmp / "runs/a")
    assert (summary["epochs"], summary["global_step"]) == (
        3,
        9,
    )  # 3 epochs x 3 steps: not the default 15 epochs
    assert not list((in_tmp / "runs/a").glob("events.out.tfevents.*"))  # still no TensorBoard logger
    config = yaml.safe_load((in_tmp / "runs/a/config.yaml").read_text())
    assert config["data"]["init_args"]["batch_size"] == 32 and config["trainer"]["max_epochs"] == 3
    # An explicit change: printed, recorded in resumes.jsonl, and in config.yaml with the rest.
    assert run_cli("fit", "--ckpt_path", "last", "--trainer.max_epochs", "4") == 0
    assert "changed by this command: --trainer.max_epochs 4" in capsys.readouterr().out
    resumes = [json.loads(line) for line in (in_tmp / "runs/a/resumes.jsonl").read_text().splitlines()]
    assert [r["changes"] for r in resumes] == [[], ["--trainer.max_epochs", "4"]]
    assert read_summary(in_tmp / "runs/a")["epochs"] == 4
    assert yaml.safe_load((in_tmp / "runs/a/config.yaml").read_text())["trainer"]["max_epochs"] == 4


@pytest.mark.claim("stop-signal-saves-and-exits")
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


@pytest.mark.claim("second-ctrl-c-stops-at-once")
def test_second_ctrl_c_stops_at_once_without_saving(in_tmp, capsys):
    previous = signal.getsignal(signal.SIGINT)
    try:
        code = run_cli(
            "fit", *FLAGS, "--trainer.max_epochs", "1", "--run_dir", "r", add("DoubleCtrlC", step=1)
        )
    finally:  # Lightning ignores SIGINT after a KeyboardInterrupt; give this process its Ctrl+C back
        signal.signal(signal.SIGINT, previous)
    # Lightning turns the KeyboardInterrupt into exit 1 (trainer/call.py); 130 would mean "saved, then exited"
    assert code == 1
    # step 2 never finished: last.ckpt is the every-step checkpoint of step 1, nothing saved at the stop
    assert weights("r")["global_step"] == 1
    err = capsys.readouterr().err
    assert err.count("Received SIGINT") == 1 and "Saved " not in err


@pytest.mark.claim("last-every-30-minutes")
def test_last_ckpt_is_written_mid_epoch_every_30_minutes(in_tmp, monkeypatch):
    """The default config's time rule, on a clock moved forward instead of waiting half an hour."""
    monkeypatch.setitem(CLOCK, "offset", 0.0)
    monkeypatch.setattr(run_checkpoint, "time", FakeTime())
    flags = ["--trainer.max_epochs", "1", "--trainer.limit_val_batches", "1", "--run_dir", "r"]
    assert run_cli("fit", *flags, add("ClockJump")) == 99
    state = weights("r")
    # 29 min (< 30) after the start nothing is saved; at 31 min, after step 3, last.ckpt is: mid-epoch
    # (3 of the epoch's batches done) and not again one step later (the next 30 minutes start then).
    assert state["global_step"] == 3 and state["epoch"] == 0
    (loader_state,) = state["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert loader_state["position"] == 3


@pytest.mark.claim("epoch-order-seed-epoch")
def test_each_epochs_order_depends_only_on_seed_and_epoch():
    def orders(seed: int) -> list:
        # fresh samplers, the global random streams disturbed in between: nothing but (seed, epoch) counts
        random.seed(seed + 1)
        np.random.seed(seed + 2)
        torch.manual_seed(seed + 3)
        # the one sampler of every training loader, iterated as a loader does
        sampler = EpochShard(500, seed)
        out = []
        for epoch in range(3):
            sampler.set_epoch(epoch)
            out.append(list(sampler))
        return out

    first = orders(0)
    assert orders(0) == first  # same (seed, epoch): same order, whatever the process did before
    assert first[0] != first[1] and sorted(first[0]) == list(range(500))  # another epoch: another order
    assert (
        orders(1)[0] != first[0] and orders(1)[0] != first[1]
    )  # another seed: other orders, not shifted ones

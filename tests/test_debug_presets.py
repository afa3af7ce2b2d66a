"""The debug presets of README "Configuration" (configs/debug/): each one does what its table row says.

Each runs as the README runs it (`make train ARGS="--config configs/debug/<preset>.yaml"`: default config,
progress bar, loggers and callbacks on), with only the epochs and batches shrunk where the preset leaves them
long.
"""

import csv
import importlib
import json
import math
import re
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn

from tests.conftest import CONFIGS, REPO, read_summary, run_cli

DEBUG = CONFIGS / "debug"
# The presets the README's configuration table names, in its order.
README_PRESETS = [
    "fast_dev_run",
    "overfit_batches",
    "limit_batches",
    "detect_anomaly",
    "profiler",
    "profiler_pytorch",
]


def readme_table_presets() -> list[str]:
    rows = [
        line for line in (REPO / "README.md").read_text().splitlines() if line.startswith("| `configs/debug/")
    ]
    return [
        name for row in rows for name in re.findall(r"`(?:configs/debug/)?(\w+)\.yaml`", row.split("|")[1])
    ]


@pytest.mark.claim("debug-presets-listed")
def test_every_preset_in_the_readme_table_exists_and_no_other():
    assert readme_table_presets() == README_PRESETS
    missing = [name for name in README_PRESETS if not (DEBUG / f"{name}.yaml").is_file()]
    assert not missing, f"presets named in the README but absent from configs/debug/: {missing}"
    assert sorted(p.stem for p in DEBUG.glob("*.yaml")) == sorted(README_PRESETS)  # none undocumented


# --- fast_dev_run ------------------------------------------------------------------------------------------


class CountBatches(Callback):
    """Counts the batches of each stage (sanity check excluded)."""

    seen: Counter = Counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        CountBatches.seen["train"] += 1

    def on_validation_batch_end(
        self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0
    ) -> None:
        CountBatches.seen["val" if not trainer.sanity_checking else "sanity"] += 1

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        CountBatches.seen["test"] += 1


def files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.claim("preset-fast-dev-run")
def test_fast_dev_run_runs_one_batch_of_each_stage_and_writes_nothing(in_tmp, monkeypatch):
    monkeypatch.setattr(CountBatches, "seen", Counter())
    code = run_cli(
        "fit",
        "--config",
        DEBUG / "fast_dev_run.yaml",
        "--trainer.callbacks+=tests.test_debug_presets.CountBatches",
    )
    assert code == 0
    assert CountBatches.seen == {"train": 1, "val": 1, "test": 1}
    assert files_under(in_tmp) == []  # no run directory, no logs, no checkpoint, no summary: nothing at all


@pytest.mark.claim("preset-fast-dev-run")
def test_fast_dev_run_keeps_every_default_callback_that_writes_nothing():
    """The preset replaces the callback list (see its comment): it must stay the default one minus the writers."""
    from project.callbacks import RunReport, RunSummary

    writers = (
        ModelCheckpoint,
        RunSummary,
        RunReport,
    )  # checkpoints (and the signals' save), summary.json, report.png

    def cls(entry: dict) -> type:
        module, name = entry["class_path"].rsplit(".", 1)
        return getattr(importlib.import_module(module), name)

    default = yaml.safe_load((CONFIGS / "default.yaml").read_text())["trainer"]["callbacks"]
    preset = yaml.safe_load((DEBUG / "fast_dev_run.yaml").read_text())["trainer"]["callbacks"]
    assert preset == [c for c in default if not issubclass(cls(c), writers)]


# --- overfit_batches ---------------------------------------------------------------------------------------


def smoothing_floor(eps: float, k: int) -> float:
    """The lowest cross-entropy any model reaches against label-smoothed targets: the targets' entropy."""
    on, off = 1 - eps + eps / k, eps / k
    return -(on * math.log(on) + (k - 1) * off * math.log(off))


@pytest.mark.slow
@pytest.mark.claim("preset-overfit-batches")
def test_overfit_batches_drives_the_training_loss_to_zero(in_tmp):
    assert run_cli("fit", "--config", DEBUG / "overfit_batches.yaml", "--run_dir", "r") == 0
    preset = yaml.safe_load((DEBUG / "overfit_batches.yaml").read_text())
    rows = [r for r in csv.DictReader(open(in_tmp / "r/metrics.csv")) if r.get("train/loss")]
    assert len(rows) == preset["trainer"]["max_epochs"]  # one train/loss per epoch
    last = rows[-1]
    # "~0", from the preset's own numbers: chance is ln 10 = 2.30; default.yaml's label smoothing 0.1 would hold
    # the loss at or above its floor, 0.50 (smoothing_floor(0.1, 10)); memorised means a tenth of that floor,
    # 0.050, a mean probability of e^-0.05 = 0.95 on the right label. The preset gets under it on seeds 0-2 and
    # both ATEN_CPU_CAPABILITY paths (0.033-0.039), and stays at the floor with smoothing left on (0.515).
    floor = smoothing_floor(0.1, 10)
    assert abs(floor - 0.5003) < 1e-4
    assert float(last["train/loss"]) < floor / 10 < math.log(10)
    assert float(last["train/acc"]) == 1.0  # every sample of the 2 batches right


# --- detect_anomaly -----------------------------------------------------------------------------------------


class SqrtOfNegative(nn.Module):
    """Finite outputs and loss, NaN gradients: the classic `where` trap."""

    def __init__(self, num_classes: int, in_channels: int = 1) -> None:
        super().__init__()
        self.fc = nn.Linear(in_channels * 8 * 8, num_classes)

    def forward(self, x):
        y = self.fc(x.flatten(1))
        # where() keeps y itself below 0, so the forward pass is finite; but sqrt's gradient there is NaN, and
        # NaN x 0 (where's mask) is still NaN: the weights become NaN after the first step.
        return torch.where(y > 0, y.sqrt(), y)  # the planted op


@pytest.mark.claim("preset-detect-anomaly")
def test_detect_anomaly_names_the_op_that_made_the_nan(in_tmp):
    model = [
        "--model.init_args.model",
        "tests.test_debug_presets.SqrtOfNegative",
        "--trainer.max_epochs",
        "1",
    ]
    with warnings.catch_warnings(record=True) as caught, pytest.raises(RuntimeError) as error:
        warnings.simplefilter("always")
        run_cli(
            "fit", "--config", DEBUG / "detect_anomaly.yaml", *model, "--trainer.limit_train_batches", "2"
        )
    # The error names the backward op; autograd's warning points at the forward line that created it.
    assert "Function 'SqrtBackward0' returned nan values" in str(error.value)
    (trace,) = [str(w.message) for w in caught if "Error detected in SqrtBackward0" in str(w.message)]
    assert "test_debug_presets.py" in trace and "torch.where(y > 0, y.sqrt(), y)" in trace


# --- profiler, profiler_pytorch (with limit_batches, as the README runs them) ------------------------------


def limit_batches_run(in_tmp: Path, preset: str, *shrink: str) -> Path:
    args = [
        "--config",
        DEBUG / f"{preset}.yaml",
        "--config",
        DEBUG / "limit_batches.yaml",
        *shrink,
        "--run_dir",
        "r",
    ]
    assert run_cli("fit", *args) == 0
    return in_tmp / "r"


@pytest.mark.slow
@pytest.mark.claim("preset-profilers", "preset-limit-batches")
def test_simple_profiler_times_every_step_and_hook_on_a_limit_batches_run(in_tmp):
    run = limit_batches_run(in_tmp, "profiler")
    profile = (run / "fit-profile.txt").read_text()
    for action in (
        "run_training_batch",
        "training_step",
        "optimizer_step",
        "validation_step",
        "on_train_epoch_end",
    ):
        assert action in profile
    # limit_batches: a real 2-epoch run of 5 batches each, checkpoints and summary included.
    summary = read_summary(run)
    assert summary["epochs"] == 2 and summary["global_step"] == 2 * 5 and "test_acc" in summary
    assert (run / "checkpoints/last.ckpt").is_file() and Path(summary["best_checkpoint"]).is_file()


@pytest.mark.slow
@pytest.mark.claim("preset-profilers")
def test_pytorch_profiler_writes_a_trace_of_training_steps(in_tmp):
    # One epoch: the recording costs time (~5x a plain step here), and its schedule fits in 5 steps.
    run = limit_batches_run(in_tmp, "profiler_pytorch", "--trainer.max_epochs", "1")
    assert "Self CPU" in (run / "fit-profile.txt").read_text()  # the op table
    (trace,) = run.glob("fit-profile*.pt.trace.json")  # Chrome/Perfetto format; the test stage writes its own
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name", "").endswith("Strategy.training_step") for e in events)

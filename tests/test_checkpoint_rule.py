"""The best checkpoint is the one of lowest `val/loss` (configs/default.yaml; docs/accuracy.md "Accuracy").

The first test trains a scripted model whose validation metrics are fixed per epoch, with the checkpoint
callbacks and RunSummary exactly as configs/default.yaml declares them, so each selection rule would pick a
different epoch. The second runs the CLI with the default config and checks summary.json against metrics.csv.
"""

import csv
import importlib
import importlib.util
import json
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from torch.utils.data import DataLoader, TensorDataset

from project.callbacks import RunSummary
from project.data import digits
from project.data.splits import stratified_split
from tests.conftest import CONFIGS, QUIET, read_summary, run_cli

# epoch -> (val/acc, val/loss). Binary fractions, exact in float32, so the summary's values compare with ==.
# max val/acc keeping the earliest tie (Lightning's default with monitor=val/acc) -> epoch 1; max val/acc keeping
# the latest tie -> 2; lowest val/loss -> 3; last epoch -> 4 (and 5 after the resume).
SCRIPT = [(0.875, 0.5), (1.0, 0.375), (1.0, 0.25), (0.9375, 0.125), (0.9375, 0.1875), (1.0, 0.15625)]
PICKED = 3


class Scripted(L.LightningModule):
    """Logs SCRIPT's metrics; a buffer holds the epoch its weights were saved after, to see which file loaded."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.register_buffer("trained_epochs", torch.zeros(()))

    def training_step(self, batch, batch_idx):
        return (self.w - 1).pow(2).sum()

    def on_train_epoch_end(self) -> None:
        self.trained_epochs.fill_(self.current_epoch)

    def validation_step(self, batch, batch_idx) -> None:
        acc, loss = SCRIPT[self.current_epoch]
        self.log("val/acc", acc)
        self.log("val/loss", loss)

    def test_step(self, batch, batch_idx) -> None:
        self.log("test/acc", self.trained_epochs)  # the epoch of the weights under test

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def _loader(self):
        return DataLoader(TensorDataset(torch.zeros(2, 1)), batch_size=2)

    train_dataloader = val_dataloader = test_dataloader = _loader


def default_checkpoint_callbacks(dirpath: Path) -> list:
    """The checkpoint callbacks of configs/default.yaml (RunCheckpoint), built from their class_path and init_args."""
    built = []
    for entry in yaml.safe_load((CONFIGS / "default.yaml").read_text())["trainer"]["callbacks"]:
        module, _, name = entry["class_path"].rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        if issubclass(cls, L.pytorch.callbacks.ModelCheckpoint):
            built.append(cls(**{**entry.get("init_args", {}), "dirpath": str(dirpath)}))
    return built


def fit(root: Path, epochs: int, ckpt_path: str | None = None) -> tuple[L.Trainer, dict]:
    trainer = L.Trainer(
        max_epochs=epochs,
        callbacks=[*default_checkpoint_callbacks(root / "checkpoints"), RunSummary()],
        default_root_dir=str(root),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    model = Scripted()
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer, json.loads((root / "summary.json").read_text())


@pytest.mark.claim("best-checkpoint-min-val-loss", "summary-best-val-acc-of-selected")
def test_the_config_selects_the_lowest_val_loss_and_the_summary_reports_that_epoch(tmp_path):
    trainer, summary = fit(tmp_path, epochs=5)
    ckpt = trainer.checkpoint_callback  # the one after_fit tests and "best" resolves to
    assert Path(ckpt.best_model_path).name == f"best-epoch={PICKED:03d}.ckpt", ckpt.best_model_path
    acc, loss = SCRIPT[PICKED]
    assert summary["monitor"] == "val/loss" and summary["best_score"] == loss
    assert summary["best_val_acc"] == acc  # the selected epoch's val/acc, not the run's highest (1.0)
    assert summary["best_checkpoint"] == ckpt.best_model_path
    assert Path(summary["last_checkpoint"]).name == "last.ckpt"

    # Lightning's "best" (what --ckpt_path best means) loads the same file.
    trainer.test(trainer.lightning_module, ckpt_path="best", verbose=False)
    assert float(trainer.callback_metrics["test/acc"]) == PICKED

    # A resumed run keeps the selection and its val/acc, though the selected epoch ran before the resume.
    trainer, summary = fit(tmp_path, epochs=6, ckpt_path=str(tmp_path / "checkpoints/last.ckpt"))
    assert Path(trainer.checkpoint_callback.best_model_path).name == f"best-epoch={PICKED:03d}.ckpt"
    assert (summary["best_val_acc"], summary["best_score"], summary["epochs"]) == (acc, loss, 6)


@pytest.mark.slow
@pytest.mark.claim("best-checkpoint-min-val-loss", "summary-best-val-acc-of-selected", "summary-keys")
def test_make_train_summary_names_the_monitor_and_the_selected_epochs_val_acc(in_tmp):
    """The default config end to end (a few batches): summary.json agrees with the run's metrics.csv."""
    run = in_tmp / "run"
    args = ["--config", CONFIGS / "debug/limit_batches.yaml", *QUIET, "--trainer.max_epochs", "3"]
    assert run_cli("fit", *args, "--run_dir", run) == 0
    summary = read_summary(run)
    assert set(summary) == {  # exactly the README's list of summary.json keys ("The run directory")
        "best_val_acc", "test_acc", "test_loss", "test_acc_top5", "best_checkpoint", "last_checkpoint", "monitor",
        "best_score", "epochs", "global_step", "seed", "train_seconds",
    }  # fmt: skip
    with (run / "metrics.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if r.get("val/loss")]
    by_epoch = {int(r["epoch"]): (float(r["val/acc"]), float(r["val/loss"])) for r in rows}
    best = min(by_epoch, key=lambda e: by_epoch[e][1])
    assert Path(summary["best_checkpoint"]).name == f"best-epoch={best:03d}.ckpt", by_epoch
    assert summary["monitor"] == "val/loss"
    # metrics.csv and summary.json hold the same float32 values, printed by different code paths: equal to
    # float32 resolution (relative 2**-23), not bit for bit as text.
    assert summary["best_score"] == pytest.approx(by_epoch[best][1], rel=2**-22)
    assert summary["best_val_acc"] == pytest.approx(by_epoch[best][0], rel=2**-22)


@pytest.mark.claim("selection-held-out-excludes-test-split")
def test_the_rule_selection_never_scores_on_the_default_test_split():
    """tests/tools/select_checkpoint_rule.py scores epochs on split K's test images minus the default test split's."""
    spec = importlib.util.spec_from_file_location(
        "select_rule", CONFIGS.parent / "tests/tools/select_checkpoint_rule.py"
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    _, labels = digits.load_digits_tensors()
    _, default_test = stratified_split(labels, 0.2, 0)
    for split_seed in (1, 2, 3, 4, 5):
        _, test = stratified_split(labels, 0.2, split_seed)
        positions, held = script.held_out_indices(split_seed)
        assert held and not set(held) & set(default_test)
        assert [test[p] for p in positions] == held  # positions index that split's own test tensor
        assert set(held) == set(test) - set(default_test)  # and every other test image of the split is used

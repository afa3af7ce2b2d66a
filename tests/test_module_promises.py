"""What ClassificationModule promises about its loss, metrics, schedule and the test after fit, each checked on a
tiny real training run against values computed by hand from the batches the module received.

The hand references use a copy of the model's weights taken before each step and the batch as the module gets
it (after `on_after_batch_transfer`: normalised, augmented), so they do not trust the module's own bookkeeping.
ConvNet's dropout is 0 here: a training-mode forward pass is then deterministic, and the copy's logits are the
module's.
"""

import copy
import csv
import math
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers.logger import Logger
from torch.optim.lr_scheduler import ReduceLROnPlateau

from project.data import ImageClassificationDataModule
from project.models import ConvNet
from project.module import ClassificationModule
from tests.conftest import CONFIGS, QUIET, quiet_trainer, read_summary, run_cli

# float32 sums over a few hundred samples, computed in another order than the module's: a few ulps apart
REL = 1e-5


def make_module(**kwargs) -> ClassificationModule:
    return ClassificationModule(ConvNet(10, width=4, dropout=0.0), 10, (1, 8, 8), **kwargs)


class Recorder(Logger):
    """Every dict of metrics Lightning sends to its loggers, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append(dict(metrics))

    def values(self, key: str) -> list[float]:
        return [row[key] for row in self.rows if key in row]


class StepReference(Callback):
    """Each training step's logits by hand: a copy of the weights before the step, on the batch the module gets."""

    def __init__(self) -> None:
        self.steps: list[dict] = []  # epoch, logits, labels, and the loss the module returned for backward

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        x, y = batch
        assert x.dtype == torch.float32  # transferred and normalised: what training_step receives
        with torch.no_grad():
            logits = (
                copy.deepcopy(pl_module.model).train()(x).float()
            )  # train mode: BatchNorm's batch statistics
        self.steps.append({"epoch": trainer.current_epoch, "logits": logits, "y": y.clone()})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.steps[-1]["returned"] = float(loss)

    def losses(self, smoothing: float, epoch: int | None = None) -> list[float]:
        return [
            float(F.cross_entropy(s["logits"], s["y"], label_smoothing=smoothing))
            for s in self.steps
            if epoch is None or s["epoch"] == epoch
        ]


def fit(module, datamodule, callbacks=(), **trainer_kwargs) -> tuple:
    recorder = Recorder()
    trainer = quiet_trainer(
        **{"logger": recorder, "callbacks": list(callbacks), "num_sanity_val_steps": 0, "deterministic": True}
        | trainer_kwargs
    )
    trainer.fit(module, datamodule=datamodule)
    return trainer, recorder


@pytest.mark.claim("label-smoothing-in-loss")
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_label_smoothing_reaches_the_training_loss(smoothing):
    import lightning as L

    # The whole run from the seed: weights, and the batches' order (the loaders read PL_GLOBAL_SEED, which an
    # earlier test in the same process may have left at another value).
    L.seed_everything(0)
    reference = StepReference()
    dm = ImageClassificationDataModule(num_workers=0, batch_size=64)
    _, recorder = fit(
        make_module(label_smoothing=smoothing), dm, [reference], max_epochs=1, limit_train_batches=2,
        limit_val_batches=0,
    )  # fmt: skip
    expected, other = reference.losses(smoothing), reference.losses(0.1 - smoothing)
    # The two settings are told apart: their losses differ by far more than the comparison's tolerance. (The gap
    # is label smoothing's term, which averages to 0 over a batch with every class equally often: it is the
    # batch's class imbalance, fixed by the seed, that shows it.)
    assert min(abs(a - b) / (REL * a) for a, b in zip(expected, other)) > 10
    # the loss the optimizer steps on, each step
    assert [s["returned"] for s in reference.steps] == pytest.approx(expected, rel=REL)
    (logged,) = recorder.values("train/loss")
    assert logged == pytest.approx(sum(expected) / len(expected), rel=REL)


@pytest.mark.claim("train-metrics-epoch-means")
def test_train_loss_and_acc_are_each_epochs_own_means():
    """train/loss: the mean of the epoch's step losses; train/acc: the epoch's correct predictions / its samples."""
    torch.manual_seed(0)
    reference = StepReference()
    dm = ImageClassificationDataModule(num_workers=0, batch_size=128)
    _, recorder = fit(
        make_module(label_smoothing=0.1),
        dm,
        [reference],
        max_epochs=3,
        limit_train_batches=3,
        limit_val_batches=0,
    )
    losses, accs = recorder.values("train/loss"), recorder.values("train/acc")
    assert len(losses) == len(accs) == 3
    for epoch in range(3):
        steps = [s for s in reference.steps if s["epoch"] == epoch]
        assert len(steps) == 3
        step_losses = reference.losses(0.1, epoch)
        correct = sum(int((s["logits"].argmax(1) == s["y"]).sum()) for s in steps)
        samples = sum(len(s["y"]) for s in steps)
        assert losses[epoch] == pytest.approx(sum(step_losses) / len(step_losses), rel=REL), epoch
        assert accs[epoch] == pytest.approx(correct / samples, rel=REL), epoch
    # the epochs differ (the model trains), so a value carried over from an earlier epoch would show
    assert len({round(v, 4) for v in losses}) == 3


def hand_eval_loss(module, datamodule, loader) -> tuple[float, float]:
    """(sum of per-sample losses / samples, mean of the batch means) over a whole evaluation loader."""
    module.eval()
    total, samples, batch_means = 0.0, 0, []
    with torch.no_grad():
        for batch in loader:
            x, y = datamodule.on_after_batch_transfer(batch, 0)
            losses = F.cross_entropy(module(x).float(), y, reduction="none", label_smoothing=0.1).double()
            total += float(losses.sum())
            samples += len(y)
            batch_means.append(float(losses.mean()))
    return total / samples, sum(batch_means) / len(batch_means)


@pytest.mark.claim("eval-loss-per-sample-mean")
def test_val_and_test_loss_are_per_sample_means_over_uneven_batches():
    torch.manual_seed(0)
    dm = ImageClassificationDataModule(
        num_workers=0, batch_size=100
    )  # val 144 = 100 + 44, test 360 = 3 x 100 + 60
    module = make_module(label_smoothing=0.1)
    trainer, recorder = fit(module, dm, max_epochs=1, limit_train_batches=2)
    val_sizes = [len(batch[1]) for batch in dm.val_dataloader()]
    assert val_sizes == [100, 44]
    per_sample, batch_mean = hand_eval_loss(module, dm, dm.val_dataloader())
    assert abs(per_sample - batch_mean) > 10 * REL * per_sample  # the two means are told apart
    (logged,) = recorder.values("val/loss")
    assert logged == pytest.approx(per_sample, rel=REL)

    trainer.test(module, datamodule=dm, verbose=False)
    assert [len(batch[1]) for batch in dm.test_dataloader()][-1] == 60
    per_sample, batch_mean = hand_eval_loss(module, dm, dm.test_dataloader())
    assert abs(per_sample - batch_mean) > 10 * REL * per_sample
    assert float(trainer.callback_metrics["test/loss"]) == pytest.approx(per_sample, rel=REL)


def tiny_fit_args(run: Path, *extra: str) -> list:
    """The default config on a width-4 ConvNet, 4 batches an epoch, AdamW at lr 0.05 (high enough for
    val/loss to go up again within 3 epochs)."""
    return [
        "--config", CONFIGS / "default.yaml",
        "--model.init_args.model.init_args.width", "4",
        "--model.init_args.optimizer.init_args.lr", "0.05",
        "--trainer.limit_train_batches", "4",
        "--run_dir", run,
        *QUIET, *extra,
    ]  # fmt: skip


def logged(run: Path, key: str) -> list[dict[str, str]]:
    """The rows of the run's metrics.csv that hold `key`."""
    with (run / "metrics.csv").open() as f:
        return [row for row in csv.DictReader(f) if row.get(key)]


def per_epoch(run: Path, key: str) -> dict[int, float]:
    return {int(row["epoch"]): float(row[key]) for row in logged(run, key)}


def evaluate_checkpoint(ckpt_path: str) -> tuple[float, float]:
    module = ClassificationModule.load_from_checkpoint(ckpt_path, weights_only=True)
    trainer = quiet_trainer(deterministic=True)
    trainer.test(
        module, datamodule=ImageClassificationDataModule(num_workers=0, augment="none"), verbose=False
    )
    return float(trainer.callback_metrics["test/loss"]), float(trainer.callback_metrics["test/acc"])


@pytest.mark.claim("best-checkpoint-min-val-loss")
def test_the_test_after_fit_evaluates_the_best_checkpoint_not_the_last(in_tmp):
    run = in_tmp / "run"
    args = tiny_fit_args(run, "--trainer.max_epochs", "3", "--model.init_args.scheduler", "null")
    assert run_cli("fit", *args) == 0
    val_loss = per_epoch(run, "val/loss")
    best_epoch = min(val_loss, key=val_loss.get)
    assert best_epoch != max(val_loss), f"the setup needs a best epoch before the last: {val_loss}"
    summary = read_summary(run)
    assert Path(summary["best_checkpoint"]).name == f"best-epoch={best_epoch:03d}.ckpt"
    best, last = (
        evaluate_checkpoint(summary["best_checkpoint"]),
        evaluate_checkpoint(summary["last_checkpoint"]),
    )
    assert abs(best[0] - last[0]) > 1e-3, (best, last)  # the two checkpoints are told apart
    assert (summary["test_loss"], summary["test_acc"]) == pytest.approx(best, rel=REL), (best, last)
    test_loss = [float(row["test/loss"]) for row in logged(run, "test/loss")]  # logged, not only summarised
    assert test_loss == pytest.approx([best[0]], rel=REL)


@pytest.mark.claim("optimizer-scheduler-config")
def test_reduce_on_plateau_steps_on_val_loss(in_tmp):
    module = make_module(scheduler=partial(ReduceLROnPlateau, patience=0))
    config = module.configure_optimizers()["lr_scheduler"]
    assert (config["monitor"], config["interval"]) == ("val/loss", "epoch")

    run = in_tmp / "run"
    args = tiny_fit_args(
        run,
        "--trainer.max_epochs", "4",
        "--test_after_fit", "false",
        "--model.init_args.scheduler", "torch.optim.lr_scheduler.ReduceLROnPlateau",
        "--model.init_args.scheduler.init_args.patience", "0",
        "--model.init_args.scheduler.init_args.factor", "0.5",
    )  # fmt: skip
    assert run_cli("fit", *args) == 0
    val_loss = per_epoch(run, "val/loss")
    # LearningRateMonitor: one row at each epoch's start (no epoch column), the lr that epoch trains with
    lrs = [float(row["lr-AdamW/decay"]) for row in logged(run, "lr-AdamW/decay")]
    assert len(lrs) == len(val_loss) == 4
    # The same scheduler stepped by hand on the logged val/loss of each epoch gives each next epoch's lr.
    replay = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.05)
    plateau = ReduceLROnPlateau(replay, patience=0, factor=0.5)
    expected = [0.05]
    for epoch in range(3):
        plateau.step(val_loss[epoch])
        expected.append(replay.param_groups[0]["lr"])
    assert lrs == pytest.approx(expected, rel=1e-12), (val_loss, lrs)
    assert min(lrs) < 0.05, f"the setup needs val/loss to stop improving: {val_loss}"
    ckpt = torch.load(run / "checkpoints/last.ckpt", weights_only=True)
    (state,) = ckpt["lr_schedulers"]
    assert math.isclose(state["best"], min(val_loss.values()), rel_tol=1e-7)


@pytest.mark.claim("sanity-check-not-logged")
def test_the_sanity_check_logs_nothing_epoch_0_shows_no_untrained_val_acc():
    """Lightning's sanity check validates the untrained model; the progress bar keeps the metrics it last drew, so a
    val/acc logged there (about chance) stayed on epoch 0's bar as if measured. Nothing is logged there now."""
    import lightning as L

    from project.callbacks import ProgressBar

    class Bar(ProgressBar):
        def get_metrics(self, trainer, pl_module):
            items = super().get_metrics(trainer, pl_module)
            if trainer.sanity_checking:
                self.shown_in_sanity.append(dict(items))
            return items

    L.seed_everything(0)
    bar = Bar()
    bar.shown_in_sanity = []  # what the bar was given to draw during the sanity check
    trainer, recorder = fit(
        make_module(), ImageClassificationDataModule(num_workers=0), [bar], max_epochs=1, limit_train_batches=2,
        limit_val_batches=2, num_sanity_val_steps=2, enable_progress_bar=True,
    )  # fmt: skip
    assert bar.shown_in_sanity and not any(k.startswith("val/") for m in bar.shown_in_sanity for k in m)
    (val_acc,) = recorder.values("val/acc")  # epoch 0's own validation is logged as before
    assert 0 <= val_acc <= 1

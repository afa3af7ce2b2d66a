"""ProgressBar redraws at most every min_interval seconds, and always on a stage's last batch; a disabled bar (every
rank but 0 under DDP) reads nothing it did not set up."""

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, RichProgressBar
from lightning.pytorch.strategies import SingleDeviceStrategy

from project.callbacks import ProgressBar


class _Trainer:
    sanity_checking = False


@pytest.mark.claim("progress-bar-throttled")
def test_batches_between_redraws_are_skipped_but_the_last_is_drawn(monkeypatch):
    drawn = []
    monkeypatch.setattr(RichProgressBar, "on_train_batch_end", lambda self, t, m, o, b, i: drawn.append(i))
    monkeypatch.setattr(ProgressBar, "total_train_batches", property(lambda self: 20))
    bar = ProgressBar(min_interval=60.0)
    for i in range(20):
        bar.on_train_batch_end(_Trainer(), None, None, None, i)
    assert drawn == [0, 19]  # the first (nothing drawn yet) and the epoch's last
    drawn.clear()
    every = ProgressBar(min_interval=0.0)  # 0 = every batch, like RichProgressBar
    for i in range(5):
        every.on_train_batch_end(_Trainer(), None, None, None, i)
    assert drawn == [0, 1, 2, 3, 4]


@pytest.mark.claim("progress-bar-throttled")
def test_validation_and_test_batches_between_redraws_are_skipped(monkeypatch):
    drawn = []
    for hook in ("on_validation_batch_end", "on_test_batch_end"):
        monkeypatch.setattr(
            RichProgressBar, hook, lambda self, t, m, o, b, i, d=0, h=hook: drawn.append((h, i))
        )
    for total in ("total_val_batches_current_dataloader", "total_test_batches_current_dataloader"):
        monkeypatch.setattr(ProgressBar, total, property(lambda self: 10))
    bar = ProgressBar(min_interval=60.0)
    for i in range(10):
        bar.on_validation_batch_end(_Trainer(), None, None, None, i)
    assert drawn == [("on_validation_batch_end", 0), ("on_validation_batch_end", 9)]
    drawn.clear()
    for i in range(10):
        bar.on_test_batch_end(_Trainer(), None, None, None, i)
    assert drawn == [
        ("on_test_batch_end", 9)
    ]  # the validation's last draw was just now: only the last is due
    drawn.clear()
    sanity = _Trainer()
    sanity.sanity_checking = True  # the sanity check's 2 batches are always drawn
    for i in range(2):
        bar.on_validation_batch_end(sanity, None, None, None, i)
    assert drawn == [("on_validation_batch_end", 0), ("on_validation_batch_end", 1)]


class _NotRankZero(SingleDeviceStrategy):
    """One process that Lightning treats as a rank other than 0 of a DDP run: there, Lightning's ProgressBar.setup
    disables the bar (`if not trainer.is_global_zero: self.disable()`), and the bar never counts its batches."""

    @property
    def is_global_zero(self) -> bool:
        return False


def _every_stage(bar: ProgressBar, strategy=None, callbacks=()) -> L.Trainer:
    """Sanity check, training, validation and test, with every hook of the bar, on Lightning's BoringModel."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    trainer = L.Trainer(
        accelerator="cpu",
        strategy=strategy or "auto",
        callbacks=[bar, *callbacks],
        max_epochs=2,
        limit_train_batches=3,
        limit_val_batches=2,
        limit_test_batches=2,
        num_sanity_val_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    model = BoringModel()
    trainer.fit(model)
    trainer.test(model, verbose=False)
    return trainer


@pytest.mark.claim("ddp-make-train-ddp")
def test_a_bar_on_another_rank_than_0_runs_every_stage():
    # The crash of `make train-ddp`: rank 1's bar, disabled, read batch totals that only a drawn bar sets up.
    bar = ProgressBar(min_interval=0.0)
    trainer = _every_stage(bar, _NotRankZero(torch.device("cpu")))
    assert bar.is_disabled and bar.progress is None  # nothing was drawn on this rank
    assert trainer.state.finished and trainer.current_epoch == 2


class _Counts(Callback):
    """At each stage's end, the bar's task: (stage, batches drawn as completed, total)."""

    def __init__(self, bar: ProgressBar) -> None:
        self.bar, self.seen = bar, []

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.seen.append(("train", self.bar.train_progress_bar.completed, self.bar.train_progress_bar.total))

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            task = self.bar.val_progress_bar
            self.seen.append(("val", task.completed, task.total))

    def on_test_epoch_end(self, trainer, pl_module) -> None:
        self.seen.append(("test", self.bar.test_progress_bar.completed, self.bar.test_progress_bar.total))


@pytest.mark.claim("progress-bar-throttled")
def test_a_drawn_bar_ends_each_stage_at_its_true_count():
    bar = ProgressBar(min_interval=60.0)  # of each stage, only the batches due (first, last) are drawn
    counts = _Counts(bar)
    _every_stage(bar, callbacks=[counts])
    assert bar.is_enabled
    # 2 epochs of 3 training and 2 validation batches, then 2 test batches (the limits in _every_stage).
    assert counts.seen == [("val", 2, 2), ("train", 3, 3)] * 2 + [("test", 2, 2)]

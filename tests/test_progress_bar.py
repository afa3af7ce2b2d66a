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


def test_speed_column_shows_the_epochs_average_rate():
    # Redrawn every 0.5 s, an epoch's bar may get a single update: Rich's windowed estimate (task.speed) is then
    # None, and Lightning's column printed 0.00it/s.
    from rich.progress import Progress

    from project.callbacks.progress_bar import AverageSpeedColumn

    progress = Progress(auto_refresh=False, disable=True)
    task_id = progress.add_task("Epoch 0", total=20)
    progress.update(task_id, completed=20)
    progress.stop_task(task_id)
    task = progress.tasks[0]
    task.start_time = task.stop_time - 0.4  # 20 batches in 0.4 s
    assert task.speed is None
    assert AverageSpeedColumn(style="").render(task).plain == "50.00it/s"


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


class _Clock:
    """time.monotonic for the bar, moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _fit_trainer(**limits):
    """What run_seconds_left reads of a Trainer: the limits, where fit is."""
    from types import SimpleNamespace

    values = dict(max_epochs=10, max_steps=-1, current_epoch=0, global_step=0, accumulate_grad_batches=1)
    return SimpleNamespace(callbacks=[], **{**values, **limits})


def _epochs(bar, trainer, clock, seconds: float, n: int, first_batch: int = 0) -> None:
    """n epochs of 20 batches, `seconds` each (training and validation), from trainer.current_epoch on."""
    for _ in range(n):
        bar.on_train_epoch_start(trainer, None)
        for i in range(first_batch, 20):
            bar.on_train_batch_end(trainer, None, None, None, i)
        clock.now += seconds
        trainer.current_epoch += 1
        trainer.global_step += (20 - first_batch) // trainer.accumulate_grad_batches
        first_batch = 0


@pytest.fixture
def bar(monkeypatch):
    """A ProgressBar whose drawing is off and whose clock is a _Clock (bar.clock): only its ETA is exercised."""
    from project.callbacks import progress_bar

    clock = _Clock()
    monkeypatch.setattr(progress_bar.time, "monotonic", clock)
    for hook in ("on_train_start", "on_train_epoch_start", "on_train_batch_end"):
        monkeypatch.setattr(RichProgressBar, hook, lambda *a, **k: None)
    monkeypatch.setattr(ProgressBar, "total_train_batches", property(lambda self: 20))
    bar = ProgressBar(min_interval=0.0)
    bar.clock = clock
    return bar


def test_run_eta_counts_the_batches_left_at_the_measured_pace_validation_included(bar):
    trainer = _fit_trainer(max_epochs=10)
    bar.on_train_start(trainer, None)
    assert bar.run_seconds_left(trainer) is None  # nothing measured yet
    bar.on_train_epoch_start(trainer, None)
    for i in range(5):
        bar.on_train_batch_end(trainer, None, None, None, i)
    bar.clock.now += 1.0  # 5 of 20 training batches in 1 s: 4 s an epoch, validation not measured yet
    assert bar.run_seconds_left(trainer) == pytest.approx(4 * 10 - 1)
    for i in range(5, 20):
        bar.on_train_batch_end(trainer, None, None, None, i)
    trainer.current_epoch, bar.clock.now = 1, bar.clock.now + 5.0  # epoch 0 took 6 s, its validation included
    _epochs(bar, trainer, bar.clock, seconds=6.0, n=2)  # epochs 1 and 2: 6 s each
    bar.on_train_epoch_start(trainer, None)  # epoch 3 starts: 7 epochs left at 6 s
    assert bar.run_seconds_left(trainer) == pytest.approx(7 * 6.0)
    bar.on_train_end(trainer, None)
    assert bar.run_seconds_left(trainer) == 0.0


def test_run_eta_of_a_resumed_run_counts_from_its_batch(bar):
    trainer = _fit_trainer(max_epochs=10, current_epoch=7, global_step=152)
    bar.on_train_start(trainer, None)
    _epochs(bar, trainer, bar.clock, seconds=2.0, n=1, first_batch=12)  # resumed mid-epoch 7: 8 batches, 2 s
    bar.on_train_epoch_start(trainer, None)  # epoch 8
    assert bar.run_seconds_left(trainer) == pytest.approx(2 * 20 * 0.25)  # epochs 8 and 9 at 0.25 s a batch
    for i in range(12):
        bar.on_train_batch_end(trainer, None, None, None, i)
    bar.clock.now += 3.0  # 20 batches in 5 s: 0.25 s a batch; 8 + 20 batches left
    assert bar.run_seconds_left(trainer) == pytest.approx(28 * 0.25)


def test_run_eta_stops_at_max_steps_and_max_time(bar):
    from lightning.pytorch.callbacks import Timer

    trainer = _fit_trainer(max_epochs=100, max_steps=100, accumulate_grad_batches=2)  # 10 steps an epoch
    bar.on_train_start(trainer, None)
    _epochs(bar, trainer, bar.clock, seconds=5.0, n=1)
    bar.on_train_epoch_start(trainer, None)  # 5 s an epoch, 90 steps = 9 epochs left (not 99)
    assert bar.run_seconds_left(trainer) == pytest.approx(9 * 5.0)
    timer = Timer(duration={"seconds": 30})
    timer.time_remaining = lambda stage="train": 20.0  # max_time: Lightning's Timer, 20 s left
    trainer.callbacks = [timer]
    assert bar.run_seconds_left(trainer) == pytest.approx(20.0)
    unlimited = _fit_trainer(max_epochs=-1, max_steps=-1)
    assert bar.run_seconds_left(unlimited) is None  # no limit: nothing to count down to

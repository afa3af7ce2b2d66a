"""ProgressBar: Lightning's RichProgressBar, redrawn at most every `min_interval` seconds instead of every batch,
with the time left for the whole run, and Lightning's own messages printed above it instead of through it."""

import datetime
import logging
import math
import sys
import time

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar, Timer
from lightning.pytorch.callbacks.progress.rich_progress import ProcessingSpeedColumn
from rich.progress import ProgressColumn, Task
from rich.text import Text

# Lightning logs through StreamHandlers it creates at import ("`Trainer.fit` stopped: `max_epochs=15` reached.",
# "Restoring states from the checkpoint ...").
LIGHTNING_LOGGERS = ("lightning.pytorch", "lightning.fabric")


class AverageSpeedColumn(ProcessingSpeedColumn):
    """Batches per second since the task (this epoch's bar) started.

    Rich's own estimate needs two updates within its window; a bar redrawn every 0.5 s over sub-second epochs (the
    digits' on a CPU) rarely has them, and Lightning's column then printed 0.00it/s.
    """

    def render(self, task: Task) -> Text:
        speed = task.completed / task.elapsed if task.elapsed else 0.0
        return Text(f"{speed:>.2f}it/s", style=self.style)


class RunTimeLeftColumn(ProgressColumn):
    """`run ETA 0:01:23` on the training bar: the time left until fit ends (ProgressBar.run_seconds_left)."""

    def __init__(self, bar: "ProgressBar", style: str = "") -> None:
        super().__init__()
        self.bar, self.style = bar, style

    def render(self, task: Task) -> Text:
        if task.id != self.bar.train_progress_bar_id:
            return Text()
        left = self.bar.run_seconds_left(self.bar.trainer)
        shown = "-:--:--" if left is None else str(datetime.timedelta(seconds=round(left)))
        return Text(f"run ETA {shown}", style=self.style)


class _CurrentStderr:
    """Whatever sys.stderr is at each write: Rich's live display replaces it with a proxy that prints above the bar."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


class ProgressBar(RichProgressBar):
    """RichProgressBar whose per-batch updates are skipped until `min_interval` seconds have passed.

    The stock bar updates its task and re-reads every logged metric after each batch: with steps of a few
    milliseconds, as on the digits ConvNet, that is a visible share of the training time, and nobody reads a bar
    more often than a few times a second. The last batch of an epoch always updates, so the bar ends at its true
    count. What is left is under 1% of the digits' steady epochs, timed inside the bar's hooks.

    Why not the stock `refresh_rate` (RichProgressBar and TQDMProgressBar): it counts batches, so a value that
    suits 10 ms steps redraws too rarely for 1 s steps and too often for 1 ms ones; a time interval suits both.

    The training bar also shows `run ETA h:mm:ss`, the time left until fit ends: see `run_seconds_left`.

    Lightning's log messages (its StreamHandlers hold the stderr of import time) go through the live display
    while a stage runs, so they print above the bar: "`Trainer.fit` stopped: `max_epochs=N` reached." is logged
    while the last epoch's bar is still live, and written past Rich's back, it shifted the lines Rich erases on
    its next redraw by one: the first line of the last epoch's bar stayed on screen and the bar was drawn again
    below it (in a terminal; a pipe gets only the final frame).

    Args:
        min_interval: seconds between two redraws of a batch counter (0 = every batch, like RichProgressBar).
        leave, theme, console_kwargs: as for RichProgressBar.
    """

    def __init__(self, min_interval: float = 0.5, leave: bool = False, **kwargs) -> None:
        super().__init__(leave=leave, **kwargs)
        self.min_interval = min_interval
        self._last_draw = 0.0
        self._log_streams: dict[logging.StreamHandler, object] = {}
        self._epoch_seconds: list[float] = []  # start-to-start wall time of each whole epoch of this session
        self._epoch_start: float | None = None
        self._first_batch: int | None = None  # of the current epoch: > 0 when resumed mid-epoch
        self._batches_done = 0
        self._fit_done = False

    def configure_columns(self, trainer: "L.Trainer") -> list:
        columns = [
            AverageSpeedColumn(style=self.theme.processing_speed)
            if isinstance(c, ProcessingSpeedColumn)
            else c
            for c in super().configure_columns(trainer)
        ]
        return [*columns, RunTimeLeftColumn(self, style=self.theme.time)]

    def setup(self, trainer: "L.Trainer", pl_module: "L.LightningModule", stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if self.is_disabled:
            return
        for name in LIGHTNING_LOGGERS:
            for handler in logging.getLogger(name).handlers:
                if type(handler) is logging.StreamHandler and handler.stream in (sys.stderr, sys.__stderr__):
                    self._log_streams[handler] = handler.setStream(_CurrentStderr())

    def teardown(self, trainer: "L.Trainer", pl_module: "L.LightningModule", stage: str) -> None:
        super().teardown(trainer, pl_module, stage)  # stops the live display
        for handler, stream in self._log_streams.items():
            handler.setStream(stream)
        self._log_streams.clear()

    def on_train_start(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        self._epoch_seconds, self._epoch_start, self._fit_done = [], None, False
        super().on_train_start(trainer, pl_module)

    def on_train_epoch_start(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        now = time.monotonic()
        if self._epoch_start is not None and self._first_batch == 0:  # a whole epoch, its validation included
            self._epoch_seconds.append(now - self._epoch_start)
        self._epoch_start, self._first_batch, self._batches_done = now, None, 0
        super().on_train_epoch_start(trainer, pl_module)

    def on_train_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        self._fit_done = True
        super().on_train_end(trainer, pl_module)

    def run_seconds_left(self, trainer: "L.Trainer") -> float | None:
        """Seconds until fit ends, or None before anything is measured (or without any limit).

        An epoch's time is measured from one epoch's start to the next, so its validation and checkpoints are
        in it: the mean over this session's whole epochs (a resumed run measures its own; an epoch resumed
        mid-way is not whole). Until the first epoch ends, the first epoch's training batches alone estimate it.
        Left: the rest of the current epoch plus the epochs to max_epochs; with max_steps, the optimizer steps
        left at the same rate if fewer; with max_time, at most the time it leaves. EarlyStopping or a NaN guard
        can end a run sooner than any estimate.
        """
        if self._fit_done:
            return 0.0
        if self._epoch_start is None:
            return None
        elapsed = time.monotonic() - self._epoch_start
        total = self.total_train_batches
        done = self._batches_done - (self._first_batch or 0)
        if self._epoch_seconds:
            per_epoch = sum(self._epoch_seconds) / len(self._epoch_seconds)
        elif done > 0 and math.isfinite(total):
            per_epoch = elapsed / done * total  # training only: no validation measured yet
        else:
            per_epoch = None
        fraction = self._batches_done / total if math.isfinite(total) and total else 0.0
        left = []
        if per_epoch is not None:
            if self._first_batch:  # resumed mid-epoch: only its fraction left
                this_epoch = (1 - fraction) * per_epoch
            else:
                this_epoch = max(per_epoch - elapsed, 0.0)
            if trainer.max_epochs is not None and trainer.max_epochs >= 0:
                left.append(this_epoch + (trainer.max_epochs - trainer.current_epoch - 1) * per_epoch)
            if trainer.max_steps is not None and trainer.max_steps >= 0 and math.isfinite(total) and total:
                steps_per_epoch = math.ceil(total / trainer.accumulate_grad_batches)
                left.append((trainer.max_steps - trainer.global_step) / steps_per_epoch * per_epoch)
        for callback in trainer.callbacks:
            if isinstance(callback, Timer) and callback.time_remaining("train") is not None:
                left.append(callback.time_remaining("train"))
        return max(min(left), 0.0) if left else None

    def _due(self, batch_idx: int, total: int | float) -> bool:
        now = time.monotonic()
        if now - self._last_draw >= self.min_interval or batch_idx + 1 >= total:
            self._last_draw = now
            return True
        return False

    def on_train_batch_end(
        self, trainer: "L.Trainer", pl_module: "L.LightningModule", outputs, batch, batch_idx: int
    ) -> None:
        # A disabled bar (every rank but 0 under DDP, or enable_progress_bar false) never counted its batches:
        # the totals below are only set where the bar is drawn, so it must return before reading them.
        if self.is_disabled:
            return
        self._first_batch = batch_idx if self._first_batch is None else self._first_batch
        self._batches_done = batch_idx + 1
        if self._due(batch_idx, self.total_train_batches):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int, *rest) -> None:
        if self.is_disabled:
            return
        total = self.total_val_batches_current_dataloader
        if trainer.sanity_checking or self._due(batch_idx, total):
            super().on_validation_batch_end(trainer, pl_module, outputs, batch, batch_idx, *rest)

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int, *rest) -> None:
        if not self.is_disabled and self._due(batch_idx, self.total_test_batches_current_dataloader):
            super().on_test_batch_end(trainer, pl_module, outputs, batch, batch_idx, *rest)

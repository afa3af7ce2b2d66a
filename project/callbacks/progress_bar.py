"""ProgressBar: Lightning's RichProgressBar, redrawn at most every `min_interval` seconds, with the run's ETA."""

import datetime
import logging
import math
import sys
import time
from types import SimpleNamespace

from lightning.pytorch.callbacks import RichProgressBar, Timer
from lightning.pytorch.callbacks.progress.rich_progress import ProcessingSpeedColumn
from rich.text import Text


class AverageSpeedColumn(ProcessingSpeedColumn):
    """Batches per second since the epoch's bar started: Rich's own rate needs two updates within its window, which
    a bar redrawn every 0.5 s over sub-second epochs rarely has (it showed 0.00it/s)."""

    def render(self, task) -> Text:
        return Text(f"{task.completed / task.elapsed if task.elapsed else 0.0:>.2f}it/s", style=self.style)


class ProgressBar(RichProgressBar):
    """RichProgressBar that skips per-batch updates until `min_interval` seconds passed (a stage's last batch
    always updates, so the bar ends at its true count), and shows `run ETA` on the training bar.

    The stock bar updates its task and re-reads every logged metric after each batch, on steps of a few
    milliseconds a visible share of the training time; its `refresh_rate` counts batches, too rare for 1 s steps
    and too often for 1 ms ones. Lightning's log messages ("`Trainer.fit` stopped: ...", while the last bar is
    live) are printed above the bar: its StreamHandlers hold the stderr of import time, and written past Rich's
    live display they shifted the lines Rich erases, which left a copy of the bar on screen.

    Args:
        min_interval: seconds between two redraws of a batch counter (0 = every batch, like RichProgressBar).
    """

    def __init__(self, min_interval: float = 0.5, leave: bool = False, **kwargs) -> None:
        super().__init__(leave=leave, **kwargs)
        self.min_interval, self._last_draw, self._streams = min_interval, 0.0, {}
        self._started, self._batches, self._in_epoch, self._fit_done = 0.0, 0, 0, False  # this session's

    def configure_columns(self, trainer) -> list:
        speed = AverageSpeedColumn(self.theme.processing_speed)
        return [
            speed if isinstance(c, ProcessingSpeedColumn) else c for c in super().configure_columns(trainer)
        ]

    def get_metrics(self, trainer, pl_module) -> dict:
        left = self.run_seconds_left(trainer)
        eta = "-:--:--" if left is None else str(datetime.timedelta(seconds=round(left)))
        return {**super().get_metrics(trainer, pl_module), "run ETA": eta}

    def setup(self, trainer, pl_module, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        # sys.stderr at each write: Rich's live display makes it a proxy that prints above the bar
        current = SimpleNamespace(write=lambda text: sys.stderr.write(text), flush=lambda: sys.stderr.flush())
        handlers = [
            h for name in ("lightning.pytorch", "lightning.fabric") for h in logging.getLogger(name).handlers
        ]
        for handler in [] if self.is_disabled else handlers:
            if type(handler) is logging.StreamHandler and handler.stream in (sys.stderr, sys.__stderr__):
                self._streams[handler] = handler.setStream(current)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        super().teardown(trainer, pl_module, stage)  # stops the live display
        while self._streams:
            handler, stream = self._streams.popitem()
            handler.setStream(stream)

    def on_train_start(self, trainer, pl_module) -> None:
        self._started, self._batches, self._fit_done = time.monotonic(), 0, False
        super().on_train_start(trainer, pl_module)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._in_epoch = 0
        super().on_train_epoch_start(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        self._fit_done = True
        super().on_train_end(trainer, pl_module)

    def run_seconds_left(self, trainer) -> float | None:
        """Seconds until fit ends at this session's pace (seconds per training batch since training started:
        validation and checkpoints included once an epoch ended), by max_epochs, max_steps or max_time (Timer),
        whichever comes first; None before the first batch, or without any limit."""
        if self._fit_done:
            return 0.0
        total = self.total_train_batches
        left = [c.time_remaining("train") for c in trainer.callbacks if isinstance(c, Timer)]
        if self._batches and math.isfinite(total):
            pace = (time.monotonic() - self._started) / self._batches
            if trainer.max_epochs is not None and trainer.max_epochs >= 0:
                left.append(((trainer.max_epochs - trainer.current_epoch) * total - self._in_epoch) * pace)
            if trainer.max_steps is not None and trainer.max_steps >= 0:
                left.append(
                    (trainer.max_steps - trainer.global_step) * trainer.accumulate_grad_batches * pace
                )
        left = [s for s in left if s is not None]
        return max(min(left), 0.0) if left else None

    def _due(self, batch_idx: int, total: str) -> bool:
        """Whether to redraw after this batch. A disabled bar (every rank but 0 under DDP) set up no totals."""
        if self.is_disabled:
            return False
        now = time.monotonic()
        if now - self._last_draw < self.min_interval and batch_idx + 1 < getattr(self, total):
            return False
        self._last_draw = now
        return True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self._batches, self._in_epoch = self._batches + 1, batch_idx + 1
        if self._due(batch_idx, "total_train_batches"):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int, *rest) -> None:
        due = trainer.sanity_checking and not self.is_disabled  # the sanity check's few batches: every one
        if due or self._due(batch_idx, "total_val_batches_current_dataloader"):
            super().on_validation_batch_end(trainer, pl_module, outputs, batch, batch_idx, *rest)

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int, *rest) -> None:
        if self._due(batch_idx, "total_test_batches_current_dataloader"):
            super().on_test_batch_end(trainer, pl_module, outputs, batch, batch_idx, *rest)

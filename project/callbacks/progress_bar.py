"""ProgressBar: Lightning's RichProgressBar, redrawn at most every `min_interval` seconds instead of every batch."""

import time

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.callbacks.progress.rich_progress import ProcessingSpeedColumn
from rich.progress import Task
from rich.text import Text


class AverageSpeedColumn(ProcessingSpeedColumn):
    """Batches per second since the task (this epoch's bar) started.

    Rich's own estimate needs two updates within its window; a bar redrawn every 0.5 s over epochs of 0.3 s rarely
    has them, and Lightning's column then printed 0.00it/s.
    """

    def render(self, task: Task) -> Text:
        speed = task.completed / task.elapsed if task.elapsed else 0.0
        return Text(f"{speed:>.2f}it/s", style=self.style)


class ProgressBar(RichProgressBar):
    """RichProgressBar whose per-batch updates are skipped until `min_interval` seconds have passed.

    The stock bar updates its task and re-reads every logged metric after each batch. On the digits ConvNet
    (20 batches of ~13 ms per epoch, 2 CPU cores) that cost ~6% of the training throughput (`make bench`);
    nobody reads a bar more often than a few times a second. The last batch of an epoch always updates, so
    the bar ends at its true count. Its hooks took 0.33% of the steady epochs' time in `make bench`
    (progress_bar_hook_fraction, 2026-12-01, AMD EPYC, 2 loaded cores).

    Why not the stock `refresh_rate` (RichProgressBar and TQDMProgressBar): it counts batches, so a value that
    suits 13 ms steps redraws too rarely for 1 s steps and too often for 1 ms ones; a time interval suits both.

    Args:
        min_interval: seconds between two redraws of a batch counter (0 = every batch, like RichProgressBar).
        leave, theme, console_kwargs: as for RichProgressBar.
    """

    def __init__(self, min_interval: float = 0.5, leave: bool = False, **kwargs) -> None:
        super().__init__(leave=leave, **kwargs)
        self.min_interval = min_interval
        self._last_draw = 0.0

    def configure_columns(self, trainer: "L.Trainer") -> list:
        return [
            AverageSpeedColumn(style=self.theme.processing_speed)
            if isinstance(c, ProcessingSpeedColumn)
            else c
            for c in super().configure_columns(trainer)
        ]

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
        if not self.is_disabled and self._due(batch_idx, self.total_train_batches):
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

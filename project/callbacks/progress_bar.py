"""ProgressBar: Lightning's RichProgressBar, redrawn at most every `min_interval` seconds."""

import logging
import sys
import time
from types import SimpleNamespace

from lightning.pytorch.callbacks import RichProgressBar


class ProgressBar(RichProgressBar):
    """RichProgressBar that skips per-batch redraws until `min_interval` seconds passed; a stage's last batch always
    redraws, so the bar ends at its true count. RichProgressBar's `refresh_rate` counts batches: too rare for 1 s
    steps, too often for 1 ms ones, where each redraw (with every logged metric re-read) is a visible share of a step.

    Lightning's log lines ("`Trainer.fit` stopped") go above the live bar: written past it, they left a copy of it.

    Args:
        min_interval: seconds between two redraws of a batch counter (0 = every batch, like RichProgressBar).
    """

    def __init__(self, min_interval: float = 0.5, leave: bool = False, **kwargs) -> None:
        super().__init__(leave=leave, **kwargs)
        self.min_interval, self._last_draw = min_interval, 0.0

    def setup(self, trainer, pl_module, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        # Lightning's handlers hold the stderr of import time; sys.stderr at each write is Rich's proxy while live.
        current = SimpleNamespace(write=lambda text: sys.stderr.write(text), flush=lambda: sys.stderr.flush())
        loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
        for handler in [] if self.is_disabled else [h for log in loggers for h in log.handlers]:
            if type(handler) is logging.StreamHandler and handler.stream in (sys.stderr, sys.__stderr__):
                handler.setStream(current)

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
        if self._due(batch_idx, "total_train_batches"):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int, *rest) -> None:
        due = trainer.sanity_checking and not self.is_disabled  # the sanity check's few batches: every one
        if due or self._due(batch_idx, "total_val_batches_current_dataloader"):
            super().on_validation_batch_end(trainer, pl_module, outputs, batch, batch_idx, *rest)

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int, *rest) -> None:
        if self._due(batch_idx, "total_test_batches_current_dataloader"):
            super().on_test_batch_end(trainer, pl_module, outputs, batch, batch_idx, *rest)

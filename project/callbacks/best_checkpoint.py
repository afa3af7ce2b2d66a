"""BestModelCheckpoint: a ModelCheckpoint that remembers the validation metrics of the checkpoint it selected."""

import os
import tempfile
from functools import cached_property
from typing import Any

import lightning as L
from fsspec.implementations.local import LocalFileSystem
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor


class BestModelCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint (same arguments, same selection by `monitor` and `mode`), plus
    `best_model_metrics`: every logged `val/*` value of the epoch whose checkpoint is `best_model_path`.

    The checkpoint is selected by one metric (`monitor`, e.g. `val/loss`); `summary.json` also reports another one
    of that same epoch (`best_val_acc` = the selected checkpoint's `val/acc`). The values travel in this callback's
    state, so a resumed run still knows them. The stock ModelCheckpoint keeps only the monitored value of each
    top-k file (`best_k_models`, `best_model_score`); the epoch's other metrics are gone once the next epoch logs,
    and logging them into the file name would not survive a resume as data.

    It overrides two private ModelCheckpoint methods, `_update_best_and_save` (to see the epoch's metrics when a
    new top-k file is chosen) and `_save_checkpoint` (to record them before that file is written, so the file's
    own state holds them): Lightning offers no public hook there. pyproject.toml pins lightning below 2.7, and
    tests/test_checkpoint_rule.py checks the summary's `best_val_acc` that these methods feed after an upgrade.

    `last` at every epoch end, written once. Lightning 2.6's ModelCheckpoint writes `last` at an epoch end only
    when it wrote a top-k file at that step, so with `save_top_k: 1` an epoch whose `val/loss` did not improve
    left `last.ckpt` one or more epochs behind (seen: epochs 5 and 10 of `make train`); this callback writes it
    then too (`_save_last_epoch_end`). When a new best file was just written at the same step, `last.ckpt`
    becomes a hard link to it (a second directory entry of the same, already fsynced, file; made under a
    temporary name and renamed over `last.ckpt`, so the swap is atomic) instead of a second serialization and
    fsync of the same state: a full, regular file that outlives the best file's removal. It differs from a
    fresh write only in this callback's `last_model_path` entry, which the best file records from the step
    before (empty in the first epoch); nothing reads it back but this callback's next save. Not a symlink
    (Lightning's `save_last: link`): that one is removed and re-created non-atomically, and in an epoch
    without a new best it points at an older epoch's file. Off local disks, or where hard links fail, `last`
    is written in full as before. The per-batch hook is taken out of Lightning's dispatch when neither a step
    nor a time trigger is set (it would only return), and `state_key` (a repr built on each hook call) is
    computed once.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.best_k_metrics: dict[str, dict[str, float]] = {}  # checkpoint path -> its val/* metrics
        self._pending: dict[str, float] | None = None

    @cached_property
    def state_key(self) -> str:
        # ModelCheckpoint's string (checkpoints key this callback's state by it), built once: its arguments are
        # fixed after __init__.
        return super().state_key

    def setup(self, trainer: "L.Trainer", pl_module: "L.LightningModule", stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if self._every_n_train_steps < 1 and self._train_time_interval is None:
            # ModelCheckpoint.on_train_batch_end saves on a step or time trigger only; without either it returns.
            # Lightning's dispatcher skips a hook that is not callable (as LeanHooks does).
            self.on_train_batch_end = None

    def on_validation_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        super().on_validation_end(trainer, pl_module)
        self._save_last_epoch_end(trainer, at_train_epoch_end=False)

    def on_train_epoch_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        super().on_train_epoch_end(trainer, pl_module)
        self._save_last_epoch_end(trainer, at_train_epoch_end=True)

    def _save_last_epoch_end(self, trainer: "L.Trainer", at_train_epoch_end: bool) -> None:
        """`last` at the epoch end where ModelCheckpoint saves (by default on_train_epoch_end, which runs after the
        epoch's validation; after validation when it runs several times an epoch) when the parent wrote nothing
        at this step (no new top-k file)."""
        if not self.save_last or self._should_skip_saving_checkpoint(trainer):
            return  # skip: also when a file was already written at this step (then `last` was too)
        if self._should_save_on_train_epoch_end(trainer) != at_train_epoch_end:
            return
        self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def _save_last_checkpoint(self, trainer: "L.Trainer", monitor_candidates: dict[str, Tensor]) -> None:
        source = self._last_checkpoint_saved
        target = self.format_checkpoint_name(monitor_candidates, self.CHECKPOINT_NAME_LAST)
        fresh = (  # a top-k file written at this very step: the state `last` would hold
            self.save_last is True
            and not self._enable_version_counter
            and source
            and source != target
            and self._last_global_step_saved == trainer.global_step
            and isinstance(self._fs, LocalFileSystem)
        )
        if not fresh or not self._link_last(trainer, source, target):
            super()._save_last_checkpoint(trainer, monitor_candidates)
            return
        previous, self.last_model_path = self.last_model_path, target
        self._last_checkpoint_saved = target
        if previous and self._should_remove_checkpoint(trainer, previous, target):
            self._remove_checkpoint(trainer, previous)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.after_save_checkpoint(self)

    @staticmethod
    def _link_last(trainer: "L.Trainer", source: str, target: str) -> bool:
        """Hard-link `source` to `target` atomically (rank 0; every rank learns the outcome)."""
        done = True
        if trainer.is_global_zero:
            tmp = ""
            try:
                fd, tmp = tempfile.mkstemp(
                    prefix=f".{os.path.basename(target)}.", suffix=".tmp", dir=os.path.dirname(target) or "."
                )
                os.close(fd)
                os.unlink(tmp)  # only the unique name was wanted: os.link needs a free one
                os.link(source, tmp)
                os.replace(tmp, target)
            except OSError:  # no hard links here (some network or FUSE filesystems): write it in full instead
                done = False
                if tmp:
                    try:
                        os.unlink(tmp)
                    except OSError:
                        pass
        return bool(trainer.strategy.broadcast(done))

    @property
    def best_model_metrics(self) -> dict[str, float]:
        return self.best_k_metrics.get(self.best_model_path, {})

    def _update_best_and_save(
        self, current: Tensor, trainer: "L.Trainer", monitor_candidates: dict[str, Tensor]
    ) -> None:
        self._pending = {
            k: float(v)
            for k, v in monitor_candidates.items()
            if k.startswith("val/") and isinstance(v, Tensor) and v.numel() == 1
        }
        try:
            super()._update_best_and_save(current, trainer, monitor_candidates)
        finally:
            self._pending = None

    def _save_checkpoint(self, trainer: "L.Trainer", filepath: str) -> None:
        # The new top-k file: its metrics are recorded before it is written, so its own state holds them too.
        if self._pending is not None:
            self.best_k_metrics = {p: m for p, m in self.best_k_metrics.items() if p in self.best_k_models}
            self.best_k_metrics[filepath] = self._pending
        super()._save_checkpoint(trainer, filepath)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "best_k_metrics": dict(self.best_k_metrics)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.best_k_metrics = dict(state_dict.get("best_k_metrics", {}))

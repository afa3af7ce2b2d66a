"""RunCheckpoint: the one callback that writes a run's checkpoints, best-*.ckpt and last.ckpt, at every trigger."""

import os
import tempfile
import time
from datetime import timedelta
from functools import cached_property
from typing import Any
from weakref import proxy

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor

from project.errors import ConfigError


class RunCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint for best-*.ckpt (its selection by `monitor` and `mode`, unchanged); last.ckpt
    is written by this class alone: at every epoch end, every `every_n_train_steps` optimizer steps, every
    `train_time_interval` of training, and when asked (`write_last`: GracefulStop on SIGTERM or Ctrl+C).

    Why not a stock ModelCheckpoint, configured:
    - It takes one trigger (steps, time or epochs), so mid-epoch saves needed a second instance, and both wrote
      last.ckpt. Here ModelCheckpoint gets the epoch trigger only and none of its own `last` (save_last=False).
    - With `save_top_k: 1` Lightning 2.6 writes `last` at an epoch end only when that epoch wrote a new best file:
      last.ckpt fell epochs behind (seen: epochs 5 and 10 of `make train`). Here every epoch end writes it.
    - A step or time save in an epoch's last batch resumes badly: Lightning 2.6 runs that epoch again (found by
      tests/tools/kill_resume.py: 24 steps instead of 18). Such saves skip that batch (`resumable_after`); the epoch-end
      save follows a moment later.
    - Under DDP its time trigger broadcasts rank 0's "is it time?" at every step, a collective (and a host sync
      with NCCL) per step for a save every half hour. Here the ranks compare the clock every
      `time_check_every_n_steps` steps (all ranks count the same steps); one process checks every step.
    - It keeps only the monitored value of each top-k file; summary.json's `best_val_acc` is another metric of the
      selected epoch. `best_model_metrics` holds every `val/*` (or `val_*`, kept as `val/*`) value of the epoch whose
      file is `best_model_path`, kept in this callback's state so a resumed run still knows them.
    - It finds a monitored key missing only after a training epoch, and then fails. Here the first validation that
      logs anything (the sanity check's, or epoch 0's for a module that logs nothing in the sanity check, as
      ClassificationModule) decides: a module that logs other keys but not `monitor` stops with one paragraph
      naming them (`--monitor <key>`); a run without validation, or whose validation logs nothing, keeps
      last.ckpt only (`monitor` becomes None) and says so once. A `train*` monitor is not checked.

    In an epoch that wrote a new best file, last.ckpt becomes a hard link to it (made under a temporary name and
    renamed over last.ckpt: atomic) instead of a second serialization and fsync of the same state: a full, regular
    file that outlives the best file's removal. Not a symlink (`save_last: link`): Lightning removes and re-creates
    that one non-atomically. Where hard links fail (some network or FUSE filesystems) last.ckpt is written in full.

    Args:
        every_n_train_steps: also write last.ckpt every this many optimizer steps, mid-epoch (0 = off).
            `--checkpoint_every_n_steps N` sets it.
        train_time_interval: also write last.ckpt when this much time passed since the last timed save (None = off).
        time_check_every_n_steps: under DDP, the ranks compare rank 0's clock every this many steps (one broadcast
            each time), so a timed save comes up to this many steps late.
        enable_version_counter: off, so that an epoch run again after a resume writes its best file under the
            same name, not best-epoch=003-v1.ckpt.
        Other arguments are ModelCheckpoint's, for best-*.ckpt.
    """

    def __init__(
        self,
        dirpath: str | None = None,
        filename: str = "best-{epoch:03d}",
        monitor: str | None = "val/loss",
        mode: str = "min",
        save_top_k: int = 1,
        every_n_train_steps: int = 0,
        train_time_interval: timedelta | None = None,
        time_check_every_n_steps: int = 10,  # as GracefulStop's check_every_n_steps
        enable_version_counter: bool = False,
        **kwargs: Any,
    ) -> None:
        if every_n_train_steps < 0 or time_check_every_n_steps < 1:
            raise ValueError(
                f"every_n_train_steps must be >= 0 and time_check_every_n_steps >= 1, got {every_n_train_steps} "
                f"and {time_check_every_n_steps}"
            )
        super().__init__(
            dirpath=dirpath,
            filename=filename,
            monitor=monitor,
            mode=mode,
            save_top_k=save_top_k,
            enable_version_counter=enable_version_counter,
            save_last=False,  # this class writes last.ckpt
            **kwargs,
        )
        self.every_n_train_steps = every_n_train_steps
        self.train_time_interval = train_time_interval
        self.time_check_every_n_steps = time_check_every_n_steps
        self.best_k_metrics: dict[str, dict[str, float]] = {}  # top-k file -> its epoch's val/* metrics
        self._selecting: L.Trainer | None = None  # set while ModelCheckpoint may write a top-k file
        self._clock = time.monotonic()
        self._last_step_saved = 0  # global step of the last last.ckpt; 0: nothing trained, nothing to save
        # Whether validation logs `monitor` is yet to be seen (a train* monitor is not checked: training logs it).
        self._unchecked = bool(monitor) and staged(monitor, "train") is None
        self._before_validation: set[str] = set()  # the keys logged before the validation that checks it
        _ = self.state_key  # by the configured monitor, also once it is dropped: a resume finds this state

    @cached_property
    def state_key(self) -> str:
        # ModelCheckpoint's string (checkpoints key this callback's state by it; it leaves out this class's own
        # triggers, so a resume with another step or time interval keeps the best files), built once rather than
        # at every hook call: its arguments are fixed after __init__.
        return super().state_key

    @property
    def last_path(self) -> str:
        return os.path.join(self.dirpath or "", self.CHECKPOINT_NAME_LAST + self.FILE_EXTENSION)

    @property
    def best_model_metrics(self) -> dict[str, float]:
        """Every logged `val/*` value of the epoch whose file is `best_model_path` ({} before the first)."""
        return self.best_k_metrics.get(self.best_model_path, {})

    @staticmethod
    def resumable_after(trainer: "L.Trainer", batch_idx: int) -> bool:
        """Whether a checkpoint written after this training batch resumes exactly: not after an epoch's last."""
        return batch_idx + 1 < trainer.num_training_batches

    def on_train_start(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        super().on_train_start(trainer, pl_module)
        self._clock = time.monotonic()
        if self._unchecked and not trainer.enable_validation:
            self._select_nothing(trainer, "it has no validation (no validation_step or val batches)")

    def on_validation_start(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        if self._unchecked:
            self._before_validation = set(trainer.callback_metrics)  # LearningRateMonitor's, train_* per step

    def _check_monitor(self, trainer: "L.Trainer") -> None:
        """After a validation, before the checkpoint is selected: does the module log `monitor`?"""
        logged = sorted(set(trainer.callback_metrics) - self._before_validation)
        if self.monitor in trainer.callback_metrics:
            self._unchecked = False
        elif logged:
            guess = next((k for k in logged if "loss" in k), logged[0])
            raise ConfigError(
                f"The module logs {', '.join(logged)} in validation, but not `{self.monitor}`, which best-*.ckpt is "
                f"selected by (monitor of the config's RunCheckpoint). Select by a key it logs: --monitor {guess} "
                "(with --mode max where higher is better)."
            )
        # A sanity check that logs nothing proves nothing: ClassificationModule logs from epoch 0's validation on.
        elif not trainer.sanity_checking:
            self._select_nothing(trainer, f"its validation logs nothing (no `{self.monitor}`)")

    def _select_nothing(self, trainer: "L.Trainer", why: str) -> None:
        self.monitor, self.save_top_k, self._unchecked = None, 0, False
        if trainer.is_global_zero:
            print(
                f"No best-*.ckpt in this run: {why} to select one by; last.ckpt is written as usual.",
                flush=True,
            )

    def on_train_batch_end(
        self, trainer: "L.Trainer", pl_module: "L.LightningModule", outputs, batch, batch_idx: int
    ) -> None:
        # ModelCheckpoint's own per-batch save has no trigger here (it got none): not called.
        step = trainer.global_step
        if not self.resumable_after(trainer, batch_idx) or step == self._last_step_saved:
            return
        due = self.every_n_train_steps > 0 and step % self.every_n_train_steps == 0
        if not due and self.train_time_interval is not None:
            if trainer.world_size == 1 or step % self.time_check_every_n_steps == 0:
                due = self._time_is_up(trainer)
        if due:
            self.write_last(trainer)

    def _time_is_up(self, trainer: "L.Trainer") -> bool:
        now = time.monotonic()
        # Rank 0's clock decides: the ranks must enter the (collective) save together.
        up = trainer.strategy.broadcast(now - self._clock >= self.train_time_interval.total_seconds())
        if up:
            self._clock = now
        return bool(up)

    def on_validation_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        if self._unchecked and trainer.state.fn == "fit":  # not `validate`: it selects no checkpoint
            self._check_monitor(trainer)
        # ModelCheckpoint selects here when validation does not run once at the epoch end (val_check_interval < 1,
        # check_val_every_n_epoch > 1); last.ckpt follows a new best file.
        if best := self._select(super().on_validation_end, trainer, pl_module):
            self.write_last(trainer, link_to=best)

    def on_train_epoch_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        # After the epoch's validation: ModelCheckpoint selects here by default, then last.ckpt, at every epoch end.
        best = self._select(super().on_train_epoch_end, trainer, pl_module)
        if not trainer.fast_dev_run and (best or trainer.global_step != self._last_step_saved):
            self.write_last(trainer, link_to=best)

    def _select(self, hook, trainer: "L.Trainer", pl_module: "L.LightningModule") -> str:
        """Run ModelCheckpoint's epoch-end hook (it may write a top-k file); the path of a new best file, else ""."""
        before = self.best_model_path
        self._selecting = trainer
        try:
            hook(trainer, pl_module)
        finally:
            self._selecting = None
        return self.best_model_path if self.best_model_path != before else ""

    def write_last(self, trainer: "L.Trainer", link_to: str = "") -> str:
        """Write last.ckpt now (every rank calls it: saving is collective under DDP) and return its path.

        link_to: a checkpoint file written at this same step, which last.ckpt then becomes a hard link to.
        """
        path = self.last_path
        self.last_model_path = path  # before the write: it is part of the state written
        if not (link_to and self._link(trainer, link_to, path)):
            trainer.save_checkpoint(path, self.save_weights_only)
        self._last_step_saved = trainer.global_step
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.after_save_checkpoint(proxy(self))
        return path

    @staticmethod
    def _link(trainer: "L.Trainer", source: str, target: str) -> bool:
        """Hard-link `source` to `target` atomically (rank 0; every rank learns the outcome)."""
        done = True
        if trainer.is_global_zero:
            tmp = ""
            try:  # the temporary name is atomic_write's, so remove_stale clears one a kill left behind
                fd, tmp = tempfile.mkstemp(
                    prefix=f".{os.path.basename(target)}.", suffix=".tmp", dir=os.path.dirname(target)
                )
                os.close(fd)
                os.unlink(tmp)  # only the unique name was wanted: os.link needs a free one
                os.link(source, tmp)
                os.replace(tmp, target)
            except OSError:
                done = False
                if tmp and os.path.exists(tmp):
                    os.unlink(tmp)
        return bool(trainer.strategy.broadcast(done))

    def state_dict(self) -> dict[str, Any]:
        if self._selecting is not None and self.best_k_models:
            # ModelCheckpoint is writing a new top-k file, which it added to best_k_models just before (so it is
            # the newest key): its epoch's metrics are recorded now, so that the file's own state holds them too.
            newest = next(reversed(self.best_k_models))
            self.best_k_metrics = {p: m for p, m in self.best_k_metrics.items() if p in self.best_k_models}
            self.best_k_metrics[newest] = stage_metrics(self._selecting.callback_metrics, "val")
        return {**super().state_dict(), "best_k_metrics": dict(self.best_k_metrics)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.best_k_metrics = dict(state_dict.get("best_k_metrics", {}))


def staged(key: str, stage: str) -> str | None:
    """`stage/name` for a key logged as `stage/name` or `stage_name` (Lightning's usual val_loss), else None."""
    for prefix in (f"{stage}/", f"{stage}_"):
        if key.startswith(prefix) and len(key) > len(prefix):
            return f"{stage}/{key[len(prefix) :]}"
    return None


def stage_metrics(metrics: dict, stage: str) -> dict[str, float]:
    """The scalar metrics of one stage (`val`, `test`), under their `stage/name` keys (`staged`)."""
    return {
        staged(k, stage): float(v)
        for k, v in metrics.items()
        if staged(k, stage) and isinstance(v, Tensor) and v.numel() == 1
    }

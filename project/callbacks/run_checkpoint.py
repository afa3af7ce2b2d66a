"""RunCheckpoint: the run's one checkpoint writer, at every trigger, with every random stream in each checkpoint."""

import os
import signal
import sys
import threading
import time
from datetime import timedelta
from functools import cached_property
from typing import Any
from weakref import proxy

import torch
from jsonargparse.typing import NonNegativeInt, PositiveInt
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor

from project.distributed import env_rank
from project.errors import ConfigError
from project.rng import capture_rng_states, restore_rng_states


class RunCheckpoint(ModelCheckpoint):
    """best-*.ckpt: ModelCheckpoint's selection by `monitor` and `mode`. last.ckpt: at every epoch end, every
    `every_n_train_steps`, every `train_time_interval`, and on SIGTERM / Ctrl+C, after which the run exits 143 / 130
    (no success for a scheduler); a second Ctrl+C stops at once, unsaved. Checkpoints hold the random states
    (Lightning saves none), restored at on_train_start, after the sanity check drew from them.

    Not Lightning's (2.6): ModelCheckpoint takes one trigger per instance, writes last.ckpt at an epoch end only
    with a new best, resumes a save after an epoch's last batch by running that epoch again, and under DDP
    broadcasts its time trigger every step; the SIGTERM handler broadcasts inside the handler (a rank the signal
    reached alone hangs) and exits 0, unsaved, in validation. Here the ranks all-reduce the signal and rank 0's clock
    every `check_every_n_steps` batches. The first validation that logs checks `monitor` (other keys stop the run,
    naming them); without validation, or with nothing logged, only last.ckpt is written.

    Args:
        every_n_train_steps: also write last.ckpt every this many optimizer steps (0 = off).
        train_time_interval: also write last.ckpt when this much training time passed since the last timed save.
        check_every_n_steps: under DDP, batches between two checks of the signals and the clock (a host read).
        enable_version_counter: off, so that an epoch run again after a resume keeps its best file's name.
    """

    def __init__(
        self,
        dirpath: str | None = None,
        filename: str = "best-{epoch:03d}",
        monitor: str | None = "val/loss",
        every_n_train_steps: NonNegativeInt = 0,
        train_time_interval: timedelta | None = None,
        check_every_n_steps: PositiveInt = 10,
        enable_version_counter: bool = False,
        **kwargs: Any,
    ) -> None:
        kwargs.update(enable_version_counter=enable_version_counter)
        super().__init__(dirpath, filename, monitor, save_last=False, **kwargs)
        self.every_n_train_steps, self.train_time_interval = every_n_train_steps, train_time_interval
        self.check_every_n_steps = check_every_n_steps
        self.best_k_metrics: dict[str, dict] = {}  # top-k file -> its val/* metrics
        self._selecting = None  # the trainer, while ModelCheckpoint may write a top-k file
        self._clock, self._last_step_saved, self._since_check = time.monotonic(), 0, 0
        # the signal received, the handlers before ours, the random states to restore
        self._received, self._previous, self._rng = None, {}, None
        self._unchecked = bool(monitor) and staged(monitor, "train") is None  # does validation log `monitor`?
        _ = self.state_key  # from the configured monitor, also once it is dropped: a resume finds this state

    @cached_property
    def state_key(self) -> str:
        # Read at every hook call; without this class's triggers, so a resume with other intervals finds the state.
        return super().state_key

    @property
    def best_model_metrics(self) -> dict[str, float]:  # every val/* of the selected epoch
        return self.best_k_metrics.get(self.best_model_path, {})

    def on_fit_start(self, trainer, pl_module) -> None:
        self._received, self._since_check = None, 0
        if threading.current_thread() is threading.main_thread():  # where handlers can be installed
            self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        self._clock, rng, self._rng = time.monotonic(), self._rng, None
        if rng is not None:
            restore_rng_states(rng)
        if self._previous:  # Lightning installed its SIGTERM handler after on_fit_start, calling ours from it
            signal.signal(signal.SIGTERM, self._handle)
        if self._unchecked and not trainer.enable_validation:
            self._select_nothing(trainer, "it has no validation (no validation_step or val batches)")

    def _handle(self, signum: int, frame) -> None:
        if not self._previous:  # fit is over (Lightning restores the handlers it found, this one among them)
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        elif self._received is not None and signum == signal.SIGINT:
            self.teardown(None, None, "fit")  # the handlers go back
            raise KeyboardInterrupt  # second Ctrl+C: stop now
        else:
            self._received, name = signum, signal.Signals(signum).name
            if env_rank() == 0:
                sys.stderr.write(f"\nReceived {name}: saving a checkpoint after this step, then exiting.\n")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self._since_check += 1  # (ModelCheckpoint's hook is not called: its step and time triggers are off)
        if batch_idx + 1 >= trainer.num_training_batches:
            return  # a save after an epoch's last batch resumes badly: the epoch-end save follows
        step, now, signum = trainer.global_step, time.monotonic(), 0
        fresh = step != self._last_step_saved
        save = fresh and self.every_n_train_steps > 0 and step % self.every_n_train_steps == 0
        if trainer.world_size == 1 or self._since_check >= self.check_every_n_steps:  # all ranks count alike
            self._since_check, interval = 0, self.train_time_interval
            timed = fresh and interval is not None and now - self._clock >= interval.total_seconds()
            flag = 2 * (self._received or 0) + (timed and trainer.is_global_zero)
            if trainer.world_size > 1:
                flag = torch.tensor([flag], device=trainer.strategy.root_device)
                flag = int(trainer.strategy.reduce(flag, reduce_op="max").item())
            signum, timed = divmod(flag, 2)
            self._clock = now if timed else self._clock
            save = save or timed or signum
        path = self.write_last(trainer) if save else ""
        if signum:
            if trainer.is_global_zero:
                sys.stderr.write(f"Saved {path}. Resume with: make resume (or --ckpt_path {path}).\n")
            self.teardown(trainer, pl_module, "fit")  # the exception path skips teardown
            raise SystemExit(128 + signum)

    def on_validation_start(self, trainer, pl_module) -> None:
        self._before_validation = set(trainer.callback_metrics)  # LearningRateMonitor's, train_*

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._unchecked and trainer.state.fn == "fit":  # not `validate`: it selects nothing
            logged = sorted(set(trainer.callback_metrics) - self._before_validation)
            if self.monitor in trainer.callback_metrics:
                self._unchecked = False
            elif logged:
                raise ConfigError(
                    f"The module logs {', '.join(logged)} in validation, but not `{self.monitor}`, which selects "
                    "best-*.ckpt (monitor of the config's RunCheckpoint). Select by a key it logs: --monitor "
                    f"{next((k for k in logged if 'loss' in k), logged[0])} (with --mode max where higher is better)."
                )
            elif not trainer.sanity_checking:  # ClassificationModule logs nothing in the sanity check
                self._select_nothing(trainer, f"its validation logs nothing (no `{self.monitor}`)")
        # ModelCheckpoint selects here when validation is not once per epoch end (val_check_interval < 1, ...)
        if self._select(super().on_validation_end, trainer, pl_module):
            self.write_last(trainer)

    def _select_nothing(self, trainer, why: str) -> None:
        self.monitor, self.save_top_k, self._unchecked = None, 0, False
        if trainer.is_global_zero:
            print(f"No best-*.ckpt in this run: {why} to select one by; last.ckpt is written as usual.")

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        best = self._select(super().on_train_epoch_end, trainer, pl_module)
        if not trainer.fast_dev_run and (best or trainer.global_step != self._last_step_saved):
            self.write_last(trainer)

    def _select(self, hook, trainer, pl_module) -> str:
        """Run ModelCheckpoint's hook (it may write a top-k file); the path of a new best file, else ""."""
        before, self._selecting = self.best_model_path, trainer
        try:
            hook(trainer, pl_module)
        finally:
            self._selecting = None
        return self.best_model_path if self.best_model_path != before else ""

    def write_last(self, trainer) -> str:
        """Write last.ckpt (every rank: saving is collective); its path."""
        path = self.last_model_path = os.path.join(self.dirpath or "", "last.ckpt")  # set first: it is saved
        trainer.save_checkpoint(path, self.save_weights_only)
        self._last_step_saved = trainer.global_step
        for logger in trainer.loggers if trainer.is_global_zero else []:
            logger.after_save_checkpoint(proxy(self))
        return path

    def state_dict(self) -> dict[str, Any]:
        if self._selecting is not None and self.best_k_models:
            # ModelCheckpoint is writing the top-k file it just added to best_k_models: its metrics go into it too.
            newest = next(reversed(self.best_k_models))
            self.best_k_metrics = {p: m for p, m in self.best_k_metrics.items() if p in self.best_k_models}
            self.best_k_metrics[newest] = stage_metrics(self._selecting.callback_metrics, "val")
        return super().state_dict() | {
            "best_k_metrics": dict(self.best_k_metrics),
            "rng": capture_rng_states(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.best_k_metrics, self._rng = dict(state_dict.get("best_k_metrics", {})), state_dict.get("rng")

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        data = trainer.datamodule  # the built-in modules check their own fingerprint in load_state_dict
        if data is not None and "fingerprint" not in (checkpoint.get(type(data).__qualname__) or {}):
            if env_rank() == 0:
                print(f"warning: {type(data).__name__} records no `fingerprint` in its state_dict(): this resume "
                      "cannot check that the data is the run's (docs/data.md).", flush=True)  # fmt: skip

    def on_exception(self, trainer, pl_module, exception) -> None:
        super().on_exception(trainer, pl_module, exception)
        self.teardown(trainer, pl_module, "fit")

    def teardown(self, trainer, pl_module, stage: str) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


def staged(key: str, stage: str) -> str | None:
    """`stage/name` for a key logged as `stage/name` or `stage_name` (Lightning's usual val_loss), else None."""
    prefix = next((p for p in (f"{stage}/", f"{stage}_") if key.startswith(p) and len(key) > len(p)), None)
    return f"{stage}/{key[len(prefix) :]}" if prefix else None


def stage_metrics(metrics: dict, stage: str) -> dict[str, float]:
    """The scalar metrics of one stage (`val`, `test`), under their `stage/name` keys."""
    scalars = {staged(k, stage): v for k, v in metrics.items() if isinstance(v, Tensor) and v.numel() == 1}
    return {k: float(v) for k, v in scalars.items() if k}

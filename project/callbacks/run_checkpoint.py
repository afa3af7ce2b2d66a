"""A run's checkpoints: RunCheckpoint writes best-*.ckpt and last.ckpt at every trigger, GracefulStop has it save on
SIGTERM / Ctrl+C, RNGState puts every random stream into each checkpoint."""

import os
import signal
import sys
import tempfile
import threading
import time
from datetime import timedelta
from functools import cached_property
from typing import Any
from weakref import proxy

import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import Tensor

from project.distributed import env_rank
from project.errors import ConfigError
from project.rng import capture_rng_states, restore_rng_states


class RunCheckpoint(ModelCheckpoint):
    """ModelCheckpoint selects best-*.ckpt (`monitor`, `mode`, its epoch trigger, unchanged); last.ckpt is this
    class's alone: at every epoch end, every `every_n_train_steps` optimizer steps, every `train_time_interval` of
    training, and when GracefulStop asks (`write_last`).

    Why not ModelCheckpoint's own last.ckpt and triggers (Lightning 2.6):
    - one trigger per instance, and a second instance (for mid-epoch saves) writes last.ckpt too;
    - with save_top_k: 1 it writes last.ckpt at an epoch end only when that epoch wrote a new best file;
    - a step or time save after an epoch's last batch resumes by running that epoch again: such saves skip that
      batch (`resumable_after`); the epoch-end save follows;
    - under DDP its time trigger broadcasts rank 0's decision at every step (a host sync with NCCL); here every
      `time_check_every_n_steps` steps (one process reads its clock every step);
    - it keeps only the monitored value of each file: `best_model_metrics` are every val/* (or val_*) value of the
      epoch of `best_model_path`, in this callback's state so that a resumed run keeps them;
    - it finds the monitored key missing only after a training epoch. Here the first validation that logs (the
      sanity check's, or epoch 0's) decides: other keys but not `monitor` stop the run naming them; no validation,
      or one that logs nothing, keeps last.ckpt only (`monitor` None), said once. A train* monitor is not checked.

    In an epoch with a new best file, last.ckpt is a hard link to it (one serialization), made under a temporary
    name and renamed over last.ckpt: atomic, unlike `save_last: link`'s symlink. Where hard links fail (some
    network filesystems) it is written in full.

    Args:
        every_n_train_steps: also write last.ckpt every this many optimizer steps, mid-epoch (0 = off).
        train_time_interval: also write last.ckpt when this much training time passed since the last timed save.
        time_check_every_n_steps: under DDP, steps between two broadcasts of rank 0's clock (a timed save comes
            up to this many steps late).
        enable_version_counter: off, so that an epoch run again after a resume keeps its best file's name.
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
        time_check_every_n_steps: int = 10,
        enable_version_counter: bool = False,
        **kwargs: Any,
    ) -> None:
        if every_n_train_steps < 0 or time_check_every_n_steps < 1:
            raise ValueError(
                "every_n_train_steps must be >= 0 and time_check_every_n_steps >= 1, got "
                f"{every_n_train_steps} and {time_check_every_n_steps}"
            )
        kwargs.update(mode=mode, save_top_k=save_top_k, enable_version_counter=enable_version_counter)
        super().__init__(dirpath, filename, monitor, save_last=False, **kwargs)  # last.ckpt is this class's
        self.every_n_train_steps, self.train_time_interval = every_n_train_steps, train_time_interval
        self.time_check_every_n_steps = time_check_every_n_steps
        self.best_k_metrics: dict[str, dict[str, float]] = {}  # top-k file -> its epoch's val/* metrics
        self._selecting = None  # the trainer, while ModelCheckpoint may write a top-k file
        self._clock, self._last_step_saved = time.monotonic(), 0  # step 0: nothing trained, nothing to save
        self._unchecked = bool(monitor) and staged(monitor, "train") is None  # does validation log `monitor`?
        self._before_validation: set[str] = set()
        _ = self.state_key  # from the configured monitor, also once it is dropped: a resume finds this state

    @cached_property
    def state_key(self) -> str:
        # Lightning reads it at every hook call; it leaves out this class's own triggers, so a resume with other
        # step or time intervals keeps the best files.
        return super().state_key

    @property
    def best_model_metrics(self) -> dict[str, float]:
        return self.best_k_metrics.get(self.best_model_path, {})

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        self._clock = time.monotonic()
        if self._unchecked and not trainer.enable_validation:
            self._select_nothing(trainer, "it has no validation (no validation_step or val batches)")

    def on_validation_start(self, trainer, pl_module) -> None:
        if self._unchecked:  # LearningRateMonitor's keys and train_* are logged before
            self._before_validation = set(trainer.callback_metrics)

    def _check_monitor(self, trainer) -> None:
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
        elif not trainer.sanity_checking:  # ClassificationModule logs nothing in the sanity check
            self._select_nothing(trainer, f"its validation logs nothing (no `{self.monitor}`)")

    def _select_nothing(self, trainer, why: str) -> None:
        self.monitor, self.save_top_k, self._unchecked = None, 0, False
        if trainer.is_global_zero:
            print(
                f"No best-*.ckpt in this run: {why} to select one by; last.ckpt is written as usual.",
                flush=True,
            )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        step = trainer.global_step  # ModelCheckpoint's own hook is not called: it has no step or time trigger
        if not resumable_after(trainer, batch_idx) or step == self._last_step_saved:
            return
        due = self.every_n_train_steps > 0 and step % self.every_n_train_steps == 0
        if not due and self.train_time_interval is not None:
            if trainer.world_size == 1 or step % self.time_check_every_n_steps == 0:
                now = time.monotonic()  # rank 0's clock decides: the ranks enter the collective save together
                due = bool(
                    trainer.strategy.broadcast(now - self._clock >= self.train_time_interval.total_seconds())
                )
                self._clock = now if due else self._clock
        if due:
            self.write_last(trainer)

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._unchecked and trainer.state.fn == "fit":  # not `validate`: it selects nothing
            self._check_monitor(trainer)
        # ModelCheckpoint selects here when validation is not once per epoch end (val_check_interval < 1, ...)
        if best := self._select(super().on_validation_end, trainer, pl_module):
            self.write_last(trainer, link_to=best)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        best = self._select(super().on_train_epoch_end, trainer, pl_module)
        if not trainer.fast_dev_run and (best or trainer.global_step != self._last_step_saved):
            self.write_last(trainer, link_to=best)

    def _select(self, hook, trainer, pl_module) -> str:
        """Run ModelCheckpoint's hook (it may write a top-k file); the path of a new best file, else ""."""
        before, self._selecting = self.best_model_path, trainer
        try:
            hook(trainer, pl_module)
        finally:
            self._selecting = None
        return self.best_model_path if self.best_model_path != before else ""

    def write_last(self, trainer, link_to: str = "") -> str:
        """Write last.ckpt (every rank: saving is collective), a hard link to `link_to` if given; its path."""
        path = self.last_model_path = os.path.join(self.dirpath or "", "last.ckpt")  # set first: it is saved
        if not (link_to and self._link(trainer, link_to, path)):
            trainer.save_checkpoint(path, self.save_weights_only)
        self._last_step_saved = trainer.global_step
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.after_save_checkpoint(proxy(self))
        return path

    @staticmethod
    def _link(trainer, source: str, target: str) -> bool:
        done, tmp = True, ""
        if trainer.is_global_zero:
            try:  # atomic_write's temporary name, so that remove_stale clears one a kill left behind
                fd, tmp = tempfile.mkstemp(
                    prefix=f".{os.path.basename(target)}.", suffix=".tmp", dir=os.path.dirname(target)
                )
                os.close(fd)
                os.unlink(tmp)  # os.link needs a free name
                os.link(source, tmp)
                os.replace(tmp, target)
            except OSError:
                done = False
                if tmp and os.path.exists(tmp):
                    os.unlink(tmp)
        return bool(trainer.strategy.broadcast(done))

    def state_dict(self) -> dict[str, Any]:
        if self._selecting is not None and self.best_k_models:
            # ModelCheckpoint is writing the top-k file it just added to best_k_models: its metrics go into it too.
            self.best_k_metrics = {p: m for p, m in self.best_k_metrics.items() if p in self.best_k_models}
            self.best_k_metrics[next(reversed(self.best_k_models))] = stage_metrics(
                self._selecting.callback_metrics, "val"
            )
        return {**super().state_dict(), "best_k_metrics": dict(self.best_k_metrics)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.best_k_metrics = dict(state_dict.get("best_k_metrics", {}))


class GracefulStop(Callback):
    """SIGTERM / Ctrl+C: the step finishes, the run's RunCheckpoint writes last.ckpt, the run exits 128 + signal
    number (143 / 130: a scheduler sees no success). A second Ctrl+C stops at once, without saving. A signal
    during validation takes effect after the next training step. SLURM's requeue signal stays Lightning's.

    Not Lightning's handling: its SIGTERM handler ends the run with exit code 0 and nothing saved when the signal
    lands during validation, and under DDP broadcasts from inside the handler, so that a rank the signal reached
    alone hangs; SIGINT stops without saving. Under DDP the signal reaches the ranks one by one, or one alone, and
    saving is collective: every `check_every_n_steps` batches the ranks all-reduce the highest signal received
    (one scalar and a host read), and all stop at the same step. One process reads its own flag every batch.
    """

    def __init__(self, check_every_n_steps: int = 10) -> None:
        if check_every_n_steps < 1:
            raise ValueError(f"check_every_n_steps must be >= 1, got {check_every_n_steps}")
        self.check_every_n_steps = check_every_n_steps
        self._received: int | None = None
        self._previous: dict = {}
        self._since_check = 0

    def on_fit_start(self, trainer, pl_module) -> None:
        if _run_checkpoint(trainer) is None:
            raise ConfigError(
                "GracefulStop saves last.ckpt through the run's checkpoint callback, and trainer.callbacks has none: "
                "add project.callbacks.RunCheckpoint (configs/default.yaml lists it), or remove GracefulStop."
            )
        self._received, self._since_check = None, 0
        if threading.current_thread() is threading.main_thread():  # where signal handlers can be installed
            self._previous = {
                sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)
            }

    def on_train_start(self, trainer, pl_module) -> None:
        # Lightning installed its own SIGTERM handler after on_fit_start (calling ours from inside it): replaced.
        if self._previous:
            signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame) -> None:
        if not self._previous:  # fit is over (Lightning restores the handlers it found, ours among them)
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self._received is not None and signum == signal.SIGINT:
            self._restore()
            raise KeyboardInterrupt  # second Ctrl+C: stop now
        self._received = signum
        if env_rank() == 0:
            name = signal.Signals(signum).name
            print(
                f"\nReceived {name}: saving a checkpoint after this step, then exiting.",
                file=sys.stderr,
                flush=True,
            )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self._since_check += 1
        if not resumable_after(trainer, batch_idx):
            return  # on an epoch's last batch, wait for the next epoch's first
        if trainer.world_size > 1 and self._since_check < self.check_every_n_steps:
            return  # every rank counts the same batches: they all reach the next check together
        self._since_check, signum = 0, self._received or 0
        if trainer.world_size > 1:
            flag = torch.tensor([signum], device=trainer.strategy.root_device)
            signum = int(trainer.strategy.reduce(flag, reduce_op="max").item())
        if signum:
            path = _run_checkpoint(trainer).write_last(trainer)
            if trainer.is_global_zero:
                print(
                    f"Saved {path}. Resume with: make resume (or --ckpt_path {path}).",
                    file=sys.stderr,
                    flush=True,
                )
            self._restore()  # the exception path skips teardown
            raise SystemExit(128 + signum)

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._restore()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._restore()

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


class RNGState(Callback):
    """Python, NumPy, torch and CUDA random states in every checkpoint; a resumed fit continues the streams.

    Lightning seeds the streams but saves none of them, so a resumed run would draw other augmentations and
    dropout masks; its private `_collect_rng_states` gives NumPy's state as an ndarray, which weights_only loading
    refuses (project/rng.py's states are plain types). Restored at on_train_start, not at load: the sanity check
    in between draws from the global RNG, and an uninterrupted run has no such draw there.
    """

    def __init__(self) -> None:
        self._to_restore: dict | None = None

    def state_dict(self) -> dict[str, Any]:
        return capture_rng_states()  # called while a checkpoint is written

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._to_restore = state_dict

    def on_train_start(self, trainer, pl_module) -> None:
        if self._to_restore is not None:
            restore_rng_states(self._to_restore)
            self._to_restore = None


def resumable_after(trainer, batch_idx: int) -> bool:
    """Whether a checkpoint written after this training batch resumes exactly: not after an epoch's last."""
    return batch_idx + 1 < trainer.num_training_batches


def _run_checkpoint(trainer) -> RunCheckpoint | None:
    return next((c for c in trainer.checkpoint_callbacks if isinstance(c, RunCheckpoint)), None)


def staged(key: str, stage: str) -> str | None:
    """`stage/name` for a key logged as `stage/name` or `stage_name` (Lightning's usual val_loss), else None."""
    for prefix in (f"{stage}/", f"{stage}_"):
        if key.startswith(prefix) and len(key) > len(prefix):
            return f"{stage}/{key[len(prefix) :]}"
    return None


def stage_metrics(metrics: dict, stage: str) -> dict[str, float]:
    """The scalar metrics of one stage (`val`, `test`), under their `stage/name` keys."""
    return {
        staged(k, stage): float(v)
        for k, v in metrics.items()
        if staged(k, stage) and isinstance(v, Tensor) and v.numel() == 1
    }

"""GracefulStop: SIGTERM / Ctrl+C save a resumable `last` checkpoint, then exit with 143 / 130."""

import os
import signal
import sys
import threading

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from project.callbacks.run_checkpoint import RunCheckpoint
from project.distributed import env_rank
from project.errors import ConfigError


class GracefulStop(Callback):
    """Turns SIGTERM and SIGINT into "finish this step, save `last`, exit 128 + signal number".

    The run's RunCheckpoint writes last.ckpt (`write_last`), in on_train_batch_end, where its step and time saves
    happen too, so Lightning's restart logic treats it like any mid-epoch checkpoint. A signal that arrives during
    validation takes effect after the next training step. A second Ctrl+C stops at once without saving.
    Lightning's own SIGTERM handler is replaced from the first training step on (see on_train_start).
    SLURM's requeue signal (SIGUSR1 with SLURMEnvironment(auto_requeue=True)) stays with Lightning, which
    saves hpc_ckpt_<n>.ckpt into the run directory and requeues the job.
    Under DDP every rank stops at the same step, whichever ranks the signal reached (see `_agreed_signal`), and
    rank 0 alone prints.

    Why not Lightning's stock handling: its SIGTERM handler sets `trainer.received_sigterm`, which ends the run
    with exit code 0 and no checkpoint when the signal lands during validation, and under DDP broadcasts from
    inside the signal handler (a hang, see on_train_start); SIGINT makes it stop without saving.

    Args:
        check_every_n_steps: under DDP, the ranks compare their signal flags every this many training batches
            (one all-reduce of a scalar and a host read each time), so a signal takes effect up to this many
            batches late. One process reads its own flag after every batch, which costs nothing.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, check_every_n_steps: int = 10) -> None:
        if check_every_n_steps < 1:
            raise ValueError(f"check_every_n_steps must be >= 1, got {check_every_n_steps}")
        self.check_every_n_steps = check_every_n_steps
        self._received: int | None = None
        self._previous: dict = {}
        self._since_check = 0

    def on_fit_start(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        if _run_checkpoint(trainer) is None:
            raise ConfigError(
                "GracefulStop saves last.ckpt through the run's checkpoint callback, and trainer.callbacks has none: "
                "add project.callbacks.RunCheckpoint (configs/default.yaml lists it), or remove GracefulStop."
            )
        self._received = None
        self._since_check = 0
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be installed from the main thread
        for sig in self.SIGNALS:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._handle)

    def on_train_start(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        # Lightning installs its SIGTERM handler after on_fit_start, with ours called from inside it. Its own part
        # sets trainer.received_sigterm, which stops validation half-way with exit code 0 and no checkpoint (a
        # scheduler sees a success), and under DDP
        # it broadcasts from inside the signal handler: on a rank the signal reached alone, or first, that
        # broadcast pairs with another collective and the ranks hang (seen with SIGTERM sent to rank 1 of
        # `make train-ddp`). From the first training step on, SIGTERM is ours alone.
        if self._previous and signal.getsignal(signal.SIGTERM) != self._handle:
            signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame) -> None:
        if not self._previous:  # fit is over (a handler left installed must not swallow a later Ctrl+C)
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
            print(
                f"\nReceived {signal.Signals(signum).name}: saving a checkpoint after this step, then exiting.",
                file=sys.stderr,
                flush=True,
            )

    def on_train_batch_end(
        self, trainer: "L.Trainer", pl_module: "L.LightningModule", outputs, batch, batch_idx: int
    ) -> None:
        self._since_check += 1
        if not RunCheckpoint.resumable_after(trainer, batch_idx):
            return  # on an epoch's last batch, wait for the next epoch's first
        if trainer.world_size > 1 and self._since_check < self.check_every_n_steps:
            return  # every rank counts the same batches: they all reach the next check together
        self._since_check = 0
        signum = self._agreed_signal(trainer)
        if not signum:
            return
        self._received = None
        # collective under DDP: every rank is here at this step
        path = _run_checkpoint(trainer).write_last(trainer)
        if trainer.is_global_zero:
            print(
                f"Saved {path}. Resume with: make resume (or --ckpt_path {path}).",
                file=sys.stderr,
                flush=True,
            )
        self._restore()  # the exception path skips the teardown hook
        raise SystemExit(128 + signum)  # 143 for SIGTERM, 130 for SIGINT: schedulers see a non-success

    def _agreed_signal(self, trainer: "L.Trainer") -> int:
        """The signal number that every rank stops for after this step; 0 to go on.

        A signal reaches the processes of a DDP run one by one (Lightning forwards it from rank 0 to the others,
        a scheduler signals each task), or only one of them (`kill <pid>`), so each rank's own flag may say "stop"
        one step earlier or later than another's, or never. Saving is collective: a rank that entered
        save_checkpoint alone waited there while the others trained on, until the 10-minute collective timeout
        (seen with SIGTERM sent to rank 1 of `make train-ddp`). So the ranks agree on every step, taking the
        highest signal number any of them received: one all-reduce of a scalar (and its host read) every
        `check_every_n_steps` batches, only when there are several processes.
        """
        received = self._received or 0
        if trainer.world_size > 1:
            flag = torch.tensor([received], device=trainer.strategy.root_device)
            received = int(trainer.strategy.reduce(flag, reduce_op="max").item())
        return received

    def on_exception(
        self, trainer: "L.Trainer", pl_module: "L.LightningModule", exception: BaseException
    ) -> None:
        self._restore()

    def teardown(self, trainer: "L.Trainer", pl_module: "L.LightningModule", stage: str) -> None:
        self._restore()

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


def _run_checkpoint(trainer: "L.Trainer") -> RunCheckpoint | None:
    return next((c for c in trainer.checkpoint_callbacks if isinstance(c, RunCheckpoint)), None)

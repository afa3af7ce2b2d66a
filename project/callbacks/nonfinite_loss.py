"""NonFiniteLossGuard: a NaN or inf loss never reaches the weights or a checkpoint, and the run stops naming it."""

import math

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from project.errors import ConfigError

# The loss value kinds, ordered so that an all-reduce "max" picks one: 0 finite, then inf, -inf, nan.
_KINDS = {1: "inf", 2: "-inf", 3: "nan"}


class NonFiniteLossError(ConfigError):
    """The training loss became NaN or inf; the message names where and what to try."""


class NonFiniteLossGuard(Callback):
    """Skips every optimizer step from the first non-finite loss on, on the device, and stops the run at the
    next point where the host reads anyway: no device-to-host sync in the steady-state training step.

    Why not a host check per step (`loss.item()` before backward, as this callback did): on a GPU that read stalls
    the launch queue every step. Why not Lightning's stock features: `Trainer(detect_anomaly=True)` finds the op
    but costs several times the step (configs/debug/detect_anomaly.yaml); EarlyStopping(check_finite=True) reads
    a logged metric, after the NaN step has already moved the weights.

    How, per step, all on the device (three small ops, no Python float): the loss goes into this window's slot
    of a buffer, and a sticky flag `found` becomes 1.0 at the first non-finite value (it never falls back; under
    DDP the flag's value is also kept beside the loss). Before the optimizer step:

    - fused optimizers (`fused=True` in their defaults: torch's fused AdamW/Adam/SGD, the default fused AdamW)
      get `optimizer.found_inf = found`, the flag GradScaler hands them: the fused kernel
      leaves parameters, moments and step count untouched when it is set. From the first bad batch on every
      update is skipped, so the weights stay those of the last good step.
    - any other optimizer (or a GradScaler run, `16-mixed`, whose scaler replaces `found_inf` with its own
      gradient check) falls back to reading the flag on the host before each step: one sync per step, the
      cost this design removes elsewhere. Zeroing the gradients instead would not skip the step: AdamW's
      momentum and weight decay still move every weight.

    The window (flag, losses, batch positions) is read on the host, and the run stopped, at the end of each training epoch's last batch (before validation),
    every `check_every_n_steps` training batches, before every checkpoint is written (on_save_checkpoint: a
    checkpoint never holds a state after the bad step), and at the end of training. At most
    `check_every_n_steps` batches are computed in vain; the error names the first bad one.

    Under DDP the ranks agree: the flag is all-reduced (max) at each of those points, so every rank raises at
    the same one, never one alone while the others wait in a collective. Each rank's `found` also includes
    non-finite gradients, which are identical on every rank after DDP's all-reduce, so a NaN that reaches the
    gradients skips the step on every rank alike. A loss that is non-finite on one rank with finite gradients
    everywhere (unusual) skips that rank's step alone until the next check point stops the run.

    Not checked: checkpoints saved with `save_weights_only=True` mid-epoch (Lightning calls no callback hook for
    them); BatchNorm running statistics updated by the forward passes of skipped batches.

    Args:
        check_every_n_steps: training batches between two host reads of the flag (the epoch's last batch and
            every checkpoint are checked as well).
    """

    def __init__(self, check_every_n_steps: int = 100) -> None:
        if check_every_n_steps < 1:
            raise ValueError(f"check_every_n_steps must be >= 1, got {check_every_n_steps}")
        self.check_every_n_steps = check_every_n_steps
        self._found: torch.Tensor | None = None

    def on_train_start(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        n, device = self.check_every_n_steps, pl_module.device
        # Per step three small device ops and no Python float: a copy of the loss into this window's slot and the
        # sticky flag's update (1.0 from the first non-finite value on); under DDP also a copy of the flag into the
        # slot's history, since there the gradients can raise it too. The check reads the window on the host.
        self._found = torch.zeros((), dtype=torch.float32, device=device)
        self._zero = torch.zeros((), dtype=torch.float32, device=device)
        losses = torch.zeros(n, dtype=torch.float32, device=device)
        history = torch.zeros(n, dtype=torch.float32, device=device) if trainer.world_size > 1 else None
        self._buffers = (losses, history)
        self._loss_slots = list(losses.unbind())
        self._found_slots = list(history.unbind()) if history is not None else None
        self._where: list[tuple[int, int, int]] = []  # this window's (global step, epoch, batch index)

    def on_train_batch_start(
        self, trainer: "L.Trainer", pl_module: "L.LightningModule", batch, batch_idx: int
    ) -> None:
        if self._found is not None:
            self._where.append((trainer.global_step, trainer.current_epoch, batch_idx))

    def on_before_backward(
        self, trainer: "L.Trainer", pl_module: "L.LightningModule", loss: torch.Tensor
    ) -> None:
        if self._found is None:
            return
        i = len(self._where) - 1
        slot, loss = self._loss_slots[i], loss.detach()
        slot.copy_(loss if loss.ndim == 0 else loss.sum())  # a non-finite element keeps the sum non-finite
        self._raise_flag(slot)
        if self._found_slots is not None:
            self._found_slots[i].copy_(self._found)

    def on_before_optimizer_step(
        self, trainer: "L.Trainer", pl_module: "L.LightningModule", optimizer
    ) -> None:
        if self._found is None:
            return
        if self._found_slots is not None:  # several processes
            # After DDP's all-reduce the gradients are the same on every rank: so is this part of the flag.
            grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            if grads:
                self._raise_flag(torch.nn.utils.get_total_norm(grads))  # non-finite if any gradient is
                self._found_slots[len(self._where) - 1].copy_(self._found)
        if getattr(optimizer, "found_inf", None) is self._found:
            return  # set at this optimizer's first step of the fit
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if optimizer.defaults.get("fused") is True and scaler is None:
            optimizer.found_inf = self._found  # read by the fused kernel after this hook
        else:
            self._check(trainer)  # the fallback: one host read (and DDP all-reduce) per step

    def _raise_flag(self, value: torch.Tensor) -> None:
        """Set the sticky flag (in place: fused optimizers hold it) when `value` is not finite.

        found + value * 0 is found for a finite value and NaN otherwise (inf * 0 is NaN), and NaN becomes 1.0: two
        in-place ops. `isfinite` is a composite of four ops, and on a step of a few milliseconds each small op
        costs several microseconds once the model's forward and backward have run (`make bench` per_step)."""
        self._found.addcmul_(value, self._zero).nan_to_num_(nan=1.0)

    def on_train_batch_end(
        self, trainer: "L.Trainer", pl_module: "L.LightningModule", outputs, batch, batch_idx: int
    ) -> None:
        if self._found is None:
            return
        if len(self._where) >= self.check_every_n_steps or batch_idx + 1 >= trainer.num_training_batches:
            self._check(trainer)

    def on_save_checkpoint(self, trainer: "L.Trainer", pl_module: "L.LightningModule", checkpoint) -> None:
        self._check(trainer)  # before anything is written (every rank dumps the checkpoint)

    def on_train_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        self._check(trainer)

    def _check(self, trainer: "L.Trainer") -> None:
        """Read the flag on the host (all ranks agree under DDP); raise NonFiniteLossError if it is set."""
        if self._found is None:
            return
        encoded = self._state()
        if trainer.world_size > 1:
            flag = torch.tensor([encoded], device=trainer.strategy.root_device)
            encoded = int(trainer.strategy.reduce(flag, reduce_op="max").item())
        where, count = self._where, len(self._where)
        if not encoded:
            # A new window from the next batch on: every check runs after the current batch's backward (at its
            # optimizer step, its batch end or a checkpoint written there), so its slot has been read.
            self._where = []
            return
        first, kind = count - encoded // 4, encoded % 4
        step, epoch, batch_idx = (
            where[first] if 0 <= first < count else (trainer.global_step, trainer.current_epoch, -1)
        )
        self._forget_found_inf(trainer)
        last = getattr(trainer.checkpoint_callback, "last_model_path", "") or "none written yet"
        what = (
            f"The training loss is {_KINDS[kind]}"
            if kind
            else "The gradients are not finite (the loss is finite on every rank)"
        )
        raise NonFiniteLossError(
            f"{what} at global step {step}, epoch {epoch}, batch {batch_idx}; training stopped, and no optimizer "
            f"step from that batch on changed the weights (last good checkpoint: {last}). Try a lower "
            "--model.init_args.optimizer.init_args.lr, a longer warmup (--model.init_args.scheduler.init_args."
            "warmup_epochs), or --trainer.precision 32-true; to find the operation that produced it, rerun with "
            "--config configs/debug/detect_anomaly.yaml (slow)."
        )

    def _state(self) -> int:
        """This rank's first bad batch of the window and its loss kind in one number, 0 if none, larger for an
        earlier batch: every rank counts the same batches, so an all-reduce "max" gives every rank the earliest
        bad batch of any rank. A host read of the window (at most check_every_n_steps values)."""
        count = len(self._where)
        if not count or not float(self._found):
            return 0
        losses, history = (b[:count].tolist() if b is not None else None for b in self._buffers)
        if history is not None and 1.0 in history:  # DDP: the first step whose loss or gradients raised it
            first = history.index(1.0)
        else:  # one process: only a loss raises it
            first = next((j for j, v in enumerate(losses) if not math.isfinite(v)), count - 1)
        value = losses[first]
        kind = 3 if math.isnan(value) else 1 if value == math.inf else 2 if value == -math.inf else 0
        return (count - first) * 4 + kind

    def _forget_found_inf(self, trainer: "L.Trainer") -> None:
        for optimizer in trainer.optimizers:
            if hasattr(optimizer, "found_inf"):
                del optimizer.found_inf  # a later step outside this fit must not be skipped

    def on_exception(self, trainer: "L.Trainer", pl_module: "L.LightningModule", exception) -> None:
        self._forget_found_inf(trainer)

    def teardown(self, trainer: "L.Trainer", pl_module: "L.LightningModule", stage: str) -> None:
        if stage == "fit":
            self._forget_found_inf(trainer)
            self._found = None

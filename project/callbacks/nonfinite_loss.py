"""NonFiniteLossGuard: a NaN or inf loss never reaches the weights or a checkpoint, and the run stops naming it."""

import math
from functools import partial

import torch
from lightning.pytorch.callbacks import Callback

from project.errors import ConfigError

# By kind of loss value, ordered so that an all-reduce "max" picks one: 0 finite, then inf, -inf, nan.
_WHAT = ["The gradients are not finite (the loss is finite on every rank)"]
_WHAT += [f"The training loss is {kind}" for kind in ("inf", "-inf", "nan")]


class NonFiniteLossError(ConfigError):
    """The training loss became NaN or inf; the message names where and what to try."""


class NonFiniteLossGuard(Callback):
    """From the first non-finite loss on, skips every optimizer step on the device, and stops the run naming that
    batch where the host reads anyway: no device-to-host sync per step (a `loss.item()` stalls a GPU's launch
    queue). Lightning's `detect_anomaly` costs several times the step; EarlyStopping(check_finite=True) reads a
    logged metric after the NaN step has moved the weights.

    Per step, on the device: the loss goes into this window's slot, and a sticky flag `found` turns 1.0 at the
    first non-finite value (under DDP non-finite gradients raise it too: they are the same on every rank). Fused
    optimizers (torch's fused AdamW/Adam/SGD) get it as `optimizer.found_inf`, GradScaler's flag: their kernel then
    leaves parameters, moments and step count untouched. Others, and 16-mixed runs (GradScaler sets found_inf),
    read the flag on the host before each step: zeroed gradients would not stop AdamW's momentum and weight decay.
    The window is read after each epoch's last batch, every `check_every_n_steps` batches, before each checkpoint
    is written and at the end of training, all-reduced under DDP so that all ranks stop at the same point. Not
    checked: mid-epoch `save_weights_only` checkpoints (no hook runs); BatchNorm statistics of skipped batches.
    """

    def __init__(self, check_every_n_steps: int = 100) -> None:
        if check_every_n_steps < 1:
            raise ValueError(f"check_every_n_steps must be >= 1, got {check_every_n_steps}")
        self.check_every_n_steps = check_every_n_steps
        self._found: torch.Tensor | None = None
        self._where: list[tuple[int, int, int]] = []  # this window's (global step, epoch, batch index)

    def on_train_start(self, trainer, pl_module) -> None:
        zeros = partial(torch.zeros, dtype=torch.float32, device=pl_module.device)
        self._found, self._zero, self._where = zeros(()), zeros(()), []
        self._window = zeros(self.check_every_n_steps, 2)  # per batch: its loss, and the flag under DDP
        self._slots = [row.unbind() for row in self._window]  # views made once: no indexing op per step
        self._ddp = trainer.world_size > 1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if self._found is not None:
            self._where.append((trainer.global_step, trainer.current_epoch, batch_idx))

    def on_before_backward(self, trainer, pl_module, loss: torch.Tensor) -> None:
        if self._found is not None:
            loss_slot, found_slot = self._slots[len(self._where) - 1]
            loss = loss.detach()  # a non-finite element keeps the sum non-finite
            loss_slot.copy_(loss if loss.ndim == 0 else loss.sum())
            self._raise_flag(loss_slot, found_slot)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self._found is None:
            return
        if self._ddp:  # non-finite gradients, though every loss was finite
            if grads := [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]:
                self._raise_flag(torch.nn.utils.get_total_norm(grads), self._slots[len(self._where) - 1][1])
        if getattr(optimizer, "found_inf", None) is self._found:
            return  # set at this optimizer's first step of the fit
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if optimizer.defaults.get("fused") is True and scaler is None:
            optimizer.found_inf = self._found  # read by the fused kernel after this hook
        else:
            self._check(trainer)  # the fallback: one host read (and DDP all-reduce) per step

    def _raise_flag(self, value: torch.Tensor, slot: torch.Tensor) -> None:
        # found + value * 0 is NaN for a non-finite value, and NaN becomes 1.0: two in-place ops, where isfinite
        # is four (each costs microseconds on a step of milliseconds). In place: fused optimizers hold the flag.
        self._found.addcmul_(value, self._zero).nan_to_num_(nan=1.0)
        if self._ddp:  # there the gradients raise it too: which batch did is kept
            slot.copy_(self._found)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if len(self._where) >= self.check_every_n_steps or batch_idx + 1 >= trainer.num_training_batches:
            self._check(trainer)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self._check(trainer)  # before anything is written

    def on_train_end(self, trainer, pl_module) -> None:
        self._check(trainer)

    def _check(self, trainer) -> None:
        """Read the window on the host (all ranks agree under DDP); raise NonFiniteLossError if the flag is set."""
        if self._found is None:
            return
        encoded = self._state()
        if trainer.world_size > 1:
            flag = torch.tensor([encoded], device=trainer.strategy.root_device)
            encoded = int(trainer.strategy.reduce(flag, reduce_op="max").item())
        if not encoded:  # each check follows a batch's backward: the next batch starts a new window
            self._where = []
            return
        first, kind = len(self._where) - encoded // 4, encoded % 4
        fallback = (trainer.global_step, trainer.current_epoch, -1)
        step, epoch, batch_idx = self._where[first] if 0 <= first < len(self._where) else fallback
        self.on_exception(trainer, None)  # the skip flag goes: the run stops
        last = getattr(trainer.checkpoint_callback, "last_model_path", "") or "none written yet"
        raise NonFiniteLossError(
            f"{_WHAT[kind]} at global step {step}, epoch {epoch}, batch {batch_idx}; training stopped, and no optimizer "
            f"step from that batch on changed the weights (last good checkpoint: {last}). Try a lower "
            "--model.init_args.optimizer.init_args.lr, a longer warmup (--model.init_args.scheduler.init_args."
            "warmup_epochs), or --trainer.precision 32-true; to find the operation that produced it, rerun with "
            "--config configs/debug/detect_anomaly.yaml (slow)."
        )

    def _state(self) -> int:
        """This rank's first bad batch of the window and its loss kind in one number, 0 if none, larger for an
        earlier batch: every rank counts the same batches, so an all-reduce "max" gives every rank the earliest."""
        count = len(self._where)
        if not count or not float(self._found):
            return 0
        losses, found = self._window[:count].T.tolist()
        bad = found if self._ddp else [float(not math.isfinite(v)) for v in losses]
        first = bad.index(1.0) if 1.0 in bad else count - 1
        value = losses[first]
        return (count - first) * 4 + {math.inf: 1, -math.inf: 2}.get(value, 3 if math.isnan(value) else 0)

    def on_exception(self, trainer, pl_module, exception=None) -> None:
        for optimizer in trainer.optimizers:
            if hasattr(optimizer, "found_inf"):
                del optimizer.found_inf  # a later step outside this fit must not be skipped

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit":
            self._found = None
            self.on_exception(trainer, pl_module)

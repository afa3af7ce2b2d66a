"""NonFiniteLossGuard: a NaN or inf loss never reaches the weights or a checkpoint, and the run stops naming it."""

import torch
from jsonargparse.typing import PositiveInt
from lightning.pytorch.callbacks import Callback

from project.errors import ConfigError


class NonFiniteLossError(ConfigError):
    """The training loss became NaN or inf; the message names when and what to try."""


class NonFiniteLossGuard(Callback):
    """From the first non-finite loss on, skips every optimizer step on the device, and stops the run at the next
    check: no host sync per step (a `loss.item()` stalls a GPU's launch queue). `detect_anomaly` costs several steps;
    EarlyStopping(check_finite=True) reads a metric after the NaN step moved the weights.

    A sticky device flag turns 1.0 at the first non-finite loss (under DDP, gradients too). Fused optimizers get it
    as `optimizer.found_inf`, GradScaler's flag: their kernel then skips the whole update. Others read it on the
    host before each step (zeroed gradients would not stop AdamW's momentum and weight decay). Checks (all-reduced
    under DDP): each epoch's last batch, every `check_every_n_steps` batches, each checkpoint, the end of training.
    """

    def __init__(self, check_every_n_steps: PositiveInt = 100) -> None:
        self.check_every_n_steps = check_every_n_steps
        self._found: torch.Tensor | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self._found = torch.zeros((), device=pl_module.device)
        self._zero, self._unchecked, self._ddp = torch.zeros_like(self._found), 0, trainer.world_size > 1

    def on_before_backward(self, trainer, pl_module, loss: torch.Tensor) -> None:
        if self._found is not None:
            self._raise_flag(loss.detach().sum())  # a non-finite element keeps the sum non-finite

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self._found is None:
            return
        if self._ddp:  # non-finite gradients, though this rank's loss was finite
            if grads := [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]:
                self._raise_flag(torch.nn.utils.get_total_norm(grads))
        if getattr(optimizer, "found_inf", None) is self._found:
            return  # set at this optimizer's first step of the fit
        scaler = getattr(trainer.precision_plugin, "scaler", None)  # 16-mixed: GradScaler owns found_inf
        if optimizer.defaults.get("fused") is True and scaler is None:
            optimizer.found_inf = self._found  # read by the fused kernel after this hook
        else:
            self._check(trainer)  # the fallback: one host read (and DDP all-reduce) per step

    def _raise_flag(self, value: torch.Tensor) -> None:
        # found + value * 0 is NaN for a non-finite value, then 1.0: two ops, in place (fused optimizers hold it).
        self._found.addcmul_(value, self._zero).nan_to_num_(nan=1.0)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self._unchecked += 1
        if self._unchecked >= self.check_every_n_steps or batch_idx + 1 >= trainer.num_training_batches:
            self._check(trainer)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self._check(trainer)  # before anything is written

    def on_train_end(self, trainer, pl_module) -> None:
        self._check(trainer)

    def _check(self, trainer) -> None:
        """Read the flag on the host (all ranks agree under DDP); raise NonFiniteLossError if it is set."""
        if self._found is None:
            return
        found = self._found.clone()
        if trainer.world_size > 1:
            found = trainer.strategy.reduce(
                found.reshape(1).to(trainer.strategy.root_device), reduce_op="max"
            )
        self._unchecked = 0
        if not float(found.sum()):
            return
        self.on_exception(trainer, None)  # the skip flag goes: the run stops
        last = getattr(trainer.checkpoint_callback, "last_model_path", "") or "none written yet"
        raise NonFiniteLossError(
            f"The training loss (or, under DDP, the gradients) became NaN or inf by global step {trainer.global_step}"
            f", epoch {trainer.current_epoch}; training stopped, and no optimizer step from then on changed the "
            f"weights (last good checkpoint: {last}). Try a lower --model.init_args.optimizer.init_args.lr, a longer "
            "warmup (--model.init_args.scheduler.init_args.warmup_epochs), or --trainer.precision 32-true; to find "
            "the operation that produced it, rerun with --config configs/debug/detect_anomaly.yaml (slow)."
        )

    def on_exception(self, trainer, pl_module, exception=None) -> None:
        for optimizer in [o for o in trainer.optimizers if hasattr(o, "found_inf")]:
            del optimizer.found_inf  # a later step outside this fit must not be skipped

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit":
            self._found = None
            self.on_exception(trainer, pl_module)

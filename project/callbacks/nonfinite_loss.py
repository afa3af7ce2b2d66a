"""NonFiniteLossGuard: a NaN or inf loss stops the run before it can reach the weights or a checkpoint."""

import math

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from project.errors import ConfigError


class NonFiniteLossError(ConfigError):
    """The training loss became NaN or inf; the message names where and what to try."""


class NonFiniteLossGuard(Callback):
    """Checks the loss before backward; a non-finite one raises NonFiniteLossError.

    Checked before backward, so the optimizer never steps on NaN gradients: the weights in memory and every
    checkpoint (step-based ones are written after a step, in on_train_batch_end) stay those of the last good
    step. Costs one device-to-host sync of a scalar per step.
    """

    def __init__(self) -> None:
        self._batch_idx = -1

    def on_train_batch_start(
        self, trainer: "L.Trainer", pl_module: "L.LightningModule", batch, batch_idx: int
    ) -> None:
        self._batch_idx = batch_idx

    def on_before_backward(
        self, trainer: "L.Trainer", pl_module: "L.LightningModule", loss: torch.Tensor
    ) -> None:
        loss = loss.detach()
        if math.isfinite(loss.item()) if loss.numel() == 1 else bool(torch.isfinite(loss).all()):
            return
        last = getattr(trainer.checkpoint_callback, "last_model_path", "") or "none written yet"
        raise NonFiniteLossError(
            f"The training loss is {loss.float().flatten()[0].item()} at global step {trainer.global_step}, "
            f"epoch {trainer.current_epoch}, batch {self._batch_idx}; training stopped before this step changed "
            f"the weights (last good checkpoint: {last}). Try a lower --model.init_args.lr, a longer warmup "
            "(--model.init_args.warmup_epochs), or --trainer.precision 32-true; to find the operation that "
            "produced it, rerun with --config configs/debug/detect_anomaly.yaml (slow)."
        )

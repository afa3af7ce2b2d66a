"""A module's optimizer (fused Adam/AdamW where it applies, lr scaled for DDP) and schedule (`WarmupCosine`)."""

import inspect
import math

import lightning as L
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR, ReduceLROnPlateau


def attached_trainer(module: L.LightningModule) -> "L.Trainer | None":
    """The Trainer running `module`, or None when it is used on its own (a test, an export)."""
    try:
        return module.trainer
    except RuntimeError:  # Lightning: "... is not attached to a `Trainer`"
        return None


def configure(module: L.LightningModule, groups: list[dict], lr_scale: int = 1) -> dict:
    """`module.optimizer` on `groups`, every lr times `lr_scale`, and `module.scheduler` (see ClassificationModule)."""
    trainer = attached_trainer(module)
    built = module.optimizer([dict(g) for g in groups])  # copies: it fills its defaults into them
    d, params = built.defaults, [p for g in built.param_groups for p in g["params"]]
    # Adam/AdamW with `fused` unset: one kernel for all parameters. Not when the Trainer clips under mixed
    # precision: Lightning refuses to clip for an optimizer that unscales inside its step, as the fused one does.
    clips_under_amp = bool(getattr(trainer, "gradient_clip_val", None)) and isinstance(
        getattr(trainer, "precision_plugin", None), MixedPrecision
    )
    if (
        type(built) in (torch.optim.Adam, torch.optim.AdamW)
        and not (clips_under_amp or d.get("foreach") or d.get("differentiable"))
        and d.get("fused") is None
        and all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    ):
        kwargs = {k: v for k, v in d.items() if k in inspect.signature(type(built)).parameters}
        built = type(built)([dict(g) for g in groups], **kwargs | {"fused": True})
    for group in built.param_groups:  # before the scheduler records each group's peak
        group["lr"] *= lr_scale
    built.defaults["lr"] *= lr_scale
    if module.scheduler is None:
        return {"optimizer": built}
    config = {"scheduler": module.scheduler(built), "interval": "step"}
    if isinstance(config["scheduler"], ReduceLROnPlateau):
        monitor = getattr(getattr(trainer, "checkpoint_callback", None), "monitor", None)
        config.update(interval="epoch", monitor=monitor or "val/loss")
    return {"optimizer": built, "lr_scheduler": config}


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0) -> float:
    """The factor on the peak lr at optimizer step `step` (0-based): linear warmup to 1.0 (step 0 already trains)
    then a half cosine down to `min_lr_ratio` at `total_steps`."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class WarmupCosine(LambdaLR):
    """Linear warmup, then a half cosine down to `min_lr_ratio` x each group's peak lr (its lr when built).

    Its length is set in `on_train_start` (`start_schedules`): Lightning builds schedulers before a resume restores
    the loader, where `estimated_stepping_batches` would lose the restored position (Lightning issue 20550).

    Args:
        optimizer: the optimizer whose groups it schedules (LightningCLI passes it: `LRSchedulerCallable`).
        warmup_epochs: linear warmup length in epochs (fractions allowed; rounded to whole steps).
        min_lr_ratio: the cosine ends at `peak lr * min_lr_ratio`.
    """

    def __init__(self, optimizer: Optimizer, warmup_epochs: float = 1.0, min_lr_ratio: float = 0.0) -> None:
        self.warmup_epochs, self.min_lr_ratio = warmup_epochs, min_lr_ratio
        self.total_steps, self.warmup_steps = None, 0
        super().__init__(optimizer, self.factor)

    def start(self, total_steps: int, epochs: int | None) -> None:
        """Set the run's length (optimizer steps, epochs) and re-apply the current step's lr with it."""
        self.total_steps = total_steps
        self.warmup_steps = round(self.warmup_epochs * total_steps / max(1, epochs or 1))
        self._last_lr = [base_lr * self.factor(self.last_epoch) for base_lr in self.base_lrs]
        for group, lr in zip(self.optimizer.param_groups, self._last_lr, strict=True):
            group["lr"] = lr

    def factor(self, step: int) -> float:
        if self.total_steps is None:
            return 0.0
        return warmup_cosine(step, self.warmup_steps, self.total_steps, self.min_lr_ratio)


def start_schedules(trainer: L.Trainer) -> None:
    """`start` every WarmupCosine of the Trainer: its train loader is set up (and restored) by now."""
    for config in trainer.lr_scheduler_configs:
        if isinstance(config.scheduler, WarmupCosine):
            config.scheduler.start(int(trainer.estimated_stepping_batches), trainer.max_epochs)

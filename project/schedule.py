"""Learning-rate schedule: linear warmup, then cosine decay (`WarmupCosine`, the default `model.scheduler`)."""

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0) -> float:
    """Factor applied to the peak learning rate at optimizer step `step` (0-based).

    Warmup rises linearly to 1.0 over `warmup_steps` (step 0 already trains, at 1/warmup_steps),
    then a half cosine falls to `min_lr_ratio` at `total_steps`.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class WarmupCosine(LRScheduler):
    """Linear warmup over `warmup_epochs`, then a half cosine down to `min_lr_ratio` x each group's peak lr.

    Stepped after every optimizer step (the module's scheduler interval is "step"). The peak of each parameter
    group is its lr when the scheduler is built (`base_lrs`): the optimizer's lr, a group's own lr (fine-tuning),
    times the world size under `lr_scaling: linear`.

    Its length in optimizer steps is known only once training starts: `start(total_steps, epochs)` sets it, and
    ClassificationModule calls it from `on_train_start`, with `trainer.estimated_stepping_batches`. Until then
    the factor is 0. Why not when it is built: Lightning builds schedulers in `configure_optimizers`, before a
    resumed run's checkpoint is restored, and asking for `estimated_stepping_batches` there sets up the train
    loader early, so the loader position restored from the checkpoint would be lost
    (github.com/Lightning-AI/pytorch-lightning/issues/20550). By `on_train_start` the loader exists and has been
    restored.

    Args:
        optimizer: the optimizer whose groups it schedules (LightningCLI passes it: `LRSchedulerCallable`).
        warmup_epochs: linear warmup length in epochs (fractions allowed; rounded to whole steps).
        min_lr_ratio: the cosine ends at `peak lr * min_lr_ratio`.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_epochs: float = 1.0,
        min_lr_ratio: float = 0.0,
        last_epoch: int = -1,
    ) -> None:
        self.warmup_epochs = warmup_epochs
        self.min_lr_ratio = min_lr_ratio
        self.total_steps: int | None = None  # unknown until start()
        self.warmup_steps = 0
        super().__init__(optimizer, last_epoch)

    def start(self, total_steps: int, epochs: int | None) -> None:
        """Set the run's length (optimizer steps, epochs) and re-apply the current step's lr with it."""
        self.total_steps = total_steps
        self.warmup_steps = round(self.warmup_epochs * total_steps / max(1, epochs or 1))
        for group, lr in zip(self.optimizer.param_groups, self.get_lr(), strict=True):
            group["lr"] = lr
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def factor(self, step: int) -> float:
        """The multiplier of the peak lr at optimizer step `step`; 0 before `start`."""
        if self.total_steps is None:
            return 0.0
        return warmup_cosine(step, self.warmup_steps, self.total_steps, self.min_lr_ratio)

    def get_lr(self) -> list[float]:
        return [base_lr * self.factor(self.last_epoch) for base_lr in self.base_lrs]


def start_schedules(trainer) -> None:
    """`start` every WarmupCosine of the Trainer with the run's length; a module calls it from `on_train_start`,
    when the train loader is set up (and restored, on resume): see WarmupCosine."""
    for config in trainer.lr_scheduler_configs:
        if isinstance(config.scheduler, WarmupCosine):
            config.scheduler.start(int(trainer.estimated_stepping_batches), trainer.max_epochs)

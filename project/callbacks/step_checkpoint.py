"""StepCheckpoint: ModelCheckpoint for mid-epoch `last` saves that skips an epoch's last batch."""

from functools import cached_property

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint


class StepCheckpoint(ModelCheckpoint):
    """A ModelCheckpoint whose step/time-based saves never land on the last batch of an epoch.

    The stock feature is ModelCheckpoint itself, with `every_n_train_steps` or `train_time_interval` (both save in
    on_train_batch_end); this subclass only adds the skip. Why the stock one is not enough: resuming from a
    checkpoint written in on_train_batch_end of an epoch's last batch makes Lightning 2.6 run that epoch's batches
    again (found by scripts/kill_resume.py: 24 steps instead of 18), which breaks the bit-identical resume. The
    epoch-end checkpoint follows a moment later anyway, so that one batch is skipped.

    Under DDP, ModelCheckpoint's `train_time_interval` broadcasts rank 0's "is it time?" decision at every training
    step (so that the ranks cannot disagree on the clock): a collective and, with NCCL, a host sync per step, for a
    save every half hour (configs/default.yaml). Here the ranks compare the clock every `time_check_every_n_steps`
    optimizer steps instead (all ranks count the same steps, so they enter the broadcast together), and a timed
    save comes at most that many steps late. One process has nothing to agree with and checks every step.

    Without an epoch trigger (`every_n_epochs: 0`, as configs/default.yaml sets it: BestModelCheckpoint writes
    the epoch-end `last`) its epoch-end hooks would only deep-copy the logged metrics and return, so they return
    at once; `state_key` (a repr built at each hook call, once per training step here) is computed once.
    """

    time_check_every_n_steps = 10  # as GracefulStop's agreement under DDP

    @cached_property
    def state_key(self) -> str:
        # ModelCheckpoint's string (checkpoints key this callback's state by it), built once: its arguments are
        # fixed after __init__.
        return super().state_key

    def on_train_batch_end(
        self, trainer: "L.Trainer", pl_module: "L.LightningModule", outputs, batch, batch_idx: int
    ) -> None:
        if batch_idx + 1 >= trainer.num_training_batches:
            return
        step = trainer.global_step
        if (
            trainer.world_size > 1
            and self._train_time_interval is not None
            and step % self.time_check_every_n_steps
            and (self._every_n_train_steps < 1 or step % self._every_n_train_steps)
        ):
            return  # neither the step trigger nor a clock check at this step: no broadcast
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def _epoch_end_saves_nothing(self) -> bool:
        # ModelCheckpoint saves at an epoch end on an epoch trigger, or to finish a step/time save it deferred for
        # a missing monitored metric; with neither it only deep-copies the logged metrics and returns.
        return self._every_n_epochs < 1 and not self._defer_save_until_validation

    def on_train_epoch_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        if not self._epoch_end_saves_nothing():
            super().on_train_epoch_end(trainer, pl_module)

    def on_validation_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        if not self._epoch_end_saves_nothing():
            super().on_validation_end(trainer, pl_module)

"""StepCheckpoint: ModelCheckpoint for mid-epoch `last` saves that skips an epoch's last batch."""

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint


class StepCheckpoint(ModelCheckpoint):
    """A ModelCheckpoint whose step/time-based saves never land on the last batch of an epoch.

    The stock feature is ModelCheckpoint itself, with `every_n_train_steps` or `train_time_interval` (both save in
    on_train_batch_end); this subclass only adds the skip. Why the stock one is not enough: resuming from a
    checkpoint written in on_train_batch_end of an epoch's last batch makes Lightning 2.6 run that epoch's batches
    again (found by scripts/kill_resume.py: 24 steps instead of 18), which breaks the bit-identical resume. The
    epoch-end checkpoint follows a moment later anyway, so that one batch is skipped.
    """

    def on_train_batch_end(
        self, trainer: "L.Trainer", pl_module: "L.LightningModule", outputs, batch, batch_idx: int
    ) -> None:
        if batch_idx + 1 >= trainer.num_training_batches:
            return
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

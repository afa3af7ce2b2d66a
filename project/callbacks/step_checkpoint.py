"""StepCheckpoint: ModelCheckpoint for mid-epoch `last` saves that skips an epoch's last batch."""

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint


class StepCheckpoint(ModelCheckpoint):
    """A ModelCheckpoint whose step/time-based saves never land on the last batch of an epoch.

    Resuming from a checkpoint written in on_train_batch_end of an epoch's last batch makes Lightning 2.6 run
    that epoch's batches again (found by scripts/kill_resume.py: 24 steps instead of 18). The epoch-end
    checkpoint follows a moment later anyway, so that one batch is skipped.
    """

    def on_train_batch_end(
        self, trainer: "L.Trainer", pl_module: "L.LightningModule", outputs, batch, batch_idx: int
    ) -> None:
        if batch_idx + 1 >= trainer.num_training_batches:
            return
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

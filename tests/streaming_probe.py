"""What each rank of a streaming run read: StreamingDataModule with a record of every sample it hands over.

tests/test_streaming_ddp.py adds it by class_path (`--data tests.streaming_probe.RecordingStreamingDataModule`) in
place of project.data.StreamingDataModule; the data module itself is unchanged (this subclass only looks at the
batches on their way through `on_after_batch_transfer`).
"""

import hashlib
import json
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import Callback

from project.data.streaming import StreamingDataModule


def sample_key(pixels, label) -> str:
    """A stored sample's identity: its label and a hash of its uint8 pixels (prepare stores no index)."""
    return f"{int(label)}:{hashlib.sha1(pixels.contiguous().cpu().numpy().tobytes()).hexdigest()[:16]}"


class RecordingStreamingDataModule(StreamingDataModule):
    """StreamingDataModule that writes `<record_dir>/rank<r>.json`: per stage and epoch, the keys of the samples
    this rank's loaders returned, batch by batch, before augmentation and normalisation.

    Args:
        record_dir: where to write (outside the run directory, which only rank 0 writes to).
        **kwargs: StreamingDataModule's arguments.
    """

    def __init__(self, record_dir: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.record_dir = Path(record_dir)
        self.record: dict = {"train": {}, "val": {}, "test": {}, "sanity": 0, "eval_counted": {}}

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        trainer = self.trainer
        x, y = batch["image"], batch["label"]
        keys = [sample_key(p, label) for p, label in zip(x, y.tolist())]
        if trainer.sanity_checking:
            self.record["sanity"] += len(keys)
        else:
            stage = "train" if trainer.training else "val" if trainer.validating else "test"
            epoch = str(trainer.current_epoch)
            self.record[stage].setdefault(epoch, []).append(keys)
        return super().on_after_batch_transfer(batch, dataloader_idx)

    def teardown(self, stage: str) -> None:  # every rank, after fit and after test
        self.record["rank"] = self.trainer.global_rank
        self.record["world_size"] = self.trainer.world_size
        self.record_dir.mkdir(parents=True, exist_ok=True)
        out = self.record_dir / f"rank{self.trainer.global_rank}.json"
        out.write_text(json.dumps(self.record))


class EvalCounts(Callback):
    """Adds to the data module's record how many samples this rank's validation and test metrics counted.

    Callbacks run before the module's epoch-end hook, so the metric states are still this rank's own (unsynced):
    MeanMetric's `weight` = the samples its loss was updated with (weighted by batch size).
    """

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            counted = trainer.datamodule.record["eval_counted"]
            counted.setdefault("val", []).append(float(pl_module.val_loss.weight))

    def on_test_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.datamodule.record["eval_counted"].setdefault("test", []).append(
            float(pl_module.test_loss.weight)
        )

"""A callback the DDP tests add to a real run: it records what each rank saw, and can make one rank fail."""

import json
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback


class SampleProbe(Callback):
    """Writes `<out_dir>/rank<r>.json`: per-epoch training indices, eval sample counts, the world size.

    Args:
        out_dir: where to write (outside the run directory, which only rank 0 may write to).
        crash_rank: this rank raises after `crash_step` optimizer steps; -1 = nobody fails.
        crash_step: see crash_rank.
    """

    def __init__(self, out_dir: str, crash_rank: int = -1, crash_step: int = 0) -> None:
        self.out = Path(out_dir)
        self.crash_rank, self.crash_step = crash_rank, crash_step
        self.record: dict = {"train_epochs": [], "val": [], "test": []}

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.record["world_size"] = trainer.world_size
        if trainer.global_rank == 0:  # the starting weights, for the single-process replay
            torch.save(
                {k: v.detach().cpu().clone() for k, v in pl_module.state_dict().items()}, self.out / "init.pt"
            )

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        loader = trainer.train_dataloader
        # Lightning's DistributedSampler (DataLoader path) or the in-memory loader's EpochSampler, both already
        # set_epoch()-ed for this epoch.
        sampler = loader.sampler
        consumed = len(loader) * loader.batch_size  # drop_last: the tail of the shard is never read
        self.record["train_epochs"].append(
            {
                "epoch": int(sampler.epoch),
                "sampler": type(sampler).__name__,
                "indices": list(sampler)[:consumed],
            }
        )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_rank == self.crash_rank and trainer.global_step >= self.crash_step:
            (self.out / "crashed_at").write_text(repr(time.time()))  # the test times the shutdown from here
            raise RuntimeError(
                f"SampleProbe: rank {self.crash_rank} fails on purpose at step {trainer.global_step}"
            )

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Callbacks run before the module's hook, so the metric states are still this rank's own, unsynced.
        if not trainer.sanity_checking:
            self.record["val"].append(self._eval(trainer.val_dataloaders, pl_module.val_loss))

    def on_test_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.record["test"].append(self._eval(trainer.test_dataloaders, pl_module.test_loss))
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.record))

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.record))

    @staticmethod
    def _eval(loader, loss_metric) -> dict:
        # MeanMetric's `weight` state = samples this rank counted (the loss is updated with weight=batch size).
        return {
            "indices": list(loader.sampler),
            "counted": float(loss_metric.weight),
            "dataset": len(loader.dataset)
            if hasattr(loader, "dataset")
            else len(loader.labels),  # in-memory loader
        }


class PlainCNN(torch.nn.Module):
    """A BatchNorm-free, dropout-free CNN for the equivalence test.

    BatchNorm normalises over each device's batch (SyncBatchNorm, which would fix that, is GPU-only), and dropout
    draws different masks per process: either makes 2 x B on two processes differ from 2B on one by design.
    """

    def __init__(self, num_classes: int, in_channels: int = 1, width: int = 16) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(in_channels, width, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.Conv2d(width, 2 * width, 3, stride=2, padding=1),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
            torch.nn.Linear(2 * width, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

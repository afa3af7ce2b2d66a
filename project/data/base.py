"""What every data module shares; they differ only in where their samples come from. Image batches arrive as
pixels at the training size (uint8, or float in [0, 1]) and are augmented (training only) and normalised here, a
whole batch at a time on the training device."""

import hashlib
import json

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from project.data.augment import augment_training_batch
from project.data.normalize import normalize
from project.data.validate import check_batch_size
from project.errors import ConfigError
from project.rng import run_seed

# What a checkpoint's data state records, and how a refused resume names each part that changed
RECORDED = {
    "class_names": "the class names",
    "mean": "the training statistics",
    "std": "the training statistics",
    "fingerprint": "the samples in the train/val/test splits (split_seed, the fractions or the files)",
}


def fingerprint(members) -> str:
    """A short digest of what decides the splits' members (indices into the source, file paths, settings)."""
    return hashlib.sha256(json.dumps(members, sort_keys=True, default=str).encode()).hexdigest()[:16]


class ClassificationData(L.LightningDataModule):
    """A LightningDataModule whose checkpointed state (class names, split fingerprint) is checked on resume."""

    class_names: list[str]
    split_fingerprint: str | None = None  # fingerprint() of the splits' members, set when they are known
    train_set: Dataset | None = None
    val_set: Dataset | None = None
    test_set: Dataset | None = None

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def prepare_data(self) -> None:
        # Bad data fails before anything is written: Lightning creates the loggers' files between prepare_data and
        # setup, so the first process of each node loads and checks the data here (setup() keeps it).
        fn = self.trainer.state.fn if self.trainer is not None else None
        self.setup(fn.value if fn is not None else None)

    def load(self) -> None:  # sets train_set, val_set and test_set
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            self.load()
        hp, sets = self.hparams, {"train": self.train_set, "val": self.val_set, "test": self.test_set}
        if empty := [name for name, dataset in sets.items() if len(dataset) == 0]:
            counts = ", ".join(f"{k}={len(v)}" for k, v in sets.items())
            raise ConfigError(
                f"The {' and '.join(empty)} split{'s are' if len(empty) > 1 else ' is'} empty after carving "
                f"({counts}; val_fraction={hp.val_fraction}, test_fraction={hp.test_fraction}). Add data, or "
                "change --data.init_args.val_fraction / --data.init_args.test_fraction."
            )
        if stage in (None, "fit"):  # here, not only in train_dataloader(), which runs after the logs exist
            check_batch_size(len(self.train_set), self.world_size(), hp.batch_size)

    def fractions(self, given: set[str]) -> dict[str, float]:
        """The splits to carve from the training data (splits.carve): those the data does not have."""
        wanted = {"test": self.hparams.test_fraction, "val": self.hparams.val_fraction}
        return {name: f for name, f in wanted.items() if name not in given}

    def world_size(self) -> int:
        return self.trainer.world_size if self.trainer is not None else 1

    def loader(self, split: str) -> DataLoader:
        raise NotImplementedError  # the three loader hooks below call it

    def train_dataloader(self) -> DataLoader:
        return self.loader("train")

    def val_dataloader(self) -> DataLoader:
        return self.loader("val")

    def test_dataloader(self) -> DataLoader:
        return self.loader("test")

    def describe_data(self) -> str:  # how errors name this module's data
        return "the data"

    def state_dict(self) -> dict:
        return {"class_names": self.class_names, "fingerprint": self.split_fingerprint}

    def load_state_dict(self, state: dict) -> None:
        # A resume continues only what it started: the same classes, statistics and split members.
        now = self.state_dict()
        changed = dict.fromkeys(
            RECORDED[k] for k in RECORDED if None not in (state.get(k), now.get(k)) and state[k] != now[k]
        )
        if changed:
            raise ConfigError(
                f"This checkpoint was trained on other data than {self.describe_data()} holds now: "
                f"{', '.join(changed)} changed. A resume continues only the run it started: resume with the data it "
                "was trained on, or train on this data as a new run in a new directory (make train "
                'ARGS="--run_dir runs/<new name>", or python -m project fit ... --run_dir runs/<new name>).'
            )


class ImageData(ClassificationData):
    """Image classification data: pixels in, augmented (training) and normalised float32 batches out."""

    labels_checked = True  # every label is checked to be in [0, num_classes) before training
    input_shape: tuple[int, int, int]  # (C, H, W) at the training size
    mean: list[float] | None = None  # the training split's per-channel statistics (normalize.py)
    std: list[float] | None = None
    recipe: str = "none"  # the training augmentation (augment.py)
    _stats: list[Tensor] | None = None  # mean and std as (C, 1, 1) tensors on the batches' device

    @property
    def in_channels(self) -> int:
        return self.input_shape[0]

    def on_after_batch_transfer(self, batch, dataloader_idx: int) -> tuple[Tensor, Tensor]:
        x, y = (batch["image"], batch["label"]) if isinstance(batch, dict) else batch
        trainer = self.trainer
        if self.recipe != "none" and trainer is not None and trainer.training:
            # A function of (seed, epoch, batch index in the epoch, rank) only: the same after a resume.
            b, epoch = trainer.fit_loop.epoch_loop.batch_progress.current.ready, trainer.current_epoch
            x = augment_training_batch(x, self.recipe, run_seed(), epoch, b, trainer.global_rank)
        if self._stats is None or self._stats[0].device != x.device:
            self._stats = [torch.tensor(v, device=x.device).view(-1, 1, 1) for v in (self.mean, self.std)]
        return normalize(x, *self._stats), y.long()

    def state_dict(self) -> dict:
        # What predict and export need to know: the classes and the preprocessing.
        shape = list(self.input_shape)
        return super().state_dict() | {"mean": self.mean, "std": self.std, "input_shape": shape}

"""DatasetDataModule: any map-style torch Dataset (and its collate_fn), named by class_path in the config.
Batches are (inputs, y) as the collate_fn makes them; splits and loaders are the image module's."""

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Subset

from project.data.base import ClassificationData, fingerprint
from project.data.loaders import eval_loader, loader_args, train_loader
from project.data.splits import carve
from project.data.validate import check_labels
from project.errors import ConfigError
from project.versions import built_by_cli


class DatasetDataModule(ClassificationData):
    """Your own map-style Datasets, their collate_fn, seeded splits and resumable, DDP-sharded loaders.

    Args:
        train: the training Dataset (`class_path` + `init_args`), or a function annotated `-> Dataset` making one.
            Without a collate_fn, (input, label) tensor pairs (a torchvision dataset needs its `transform`).
        val: the validation Dataset; None carves `val_fraction` of `train` out (stratified by its `targets`).
        test: the test Dataset; None carves `test_fraction` of `train` out, before val.
        collate_fn: samples -> one (inputs, labels) batch: an import path or a callable class's `class_path`.
        num_classes: None reads the train dataset's `classes` (names) or `num_classes`.
        batch_size: samples per batch *per device*; the global batch is batch_size x devices x nodes.
        num_workers: loader worker processes per device; None picks one from the CPU and process count.
        pin_memory: pin host memory for faster copies to the GPU; None: when CUDA is available.
        val_fraction: share of the non-test data held out for validation when `val` is None.
        test_fraction: share of all data held out for test when `test` is None.
        split_seed: seed of the carved splits, independent of the training seed.

    Also read from the train dataset: `targets` (stratified splits, labels checked before training),
    `in_channels` (passed to the model's), `input_shape` ((C, H, W): a dry run of the model, channels_last).
    """

    def __init__(
        self,
        train: Dataset,
        val: Dataset | None = None,
        test: Dataset | None = None,
        collate_fn: Callable | None = None,
        num_classes: int | None = None,
        batch_size: int = 64,
        num_workers: int | None = None,
        pin_memory: bool | None = None,
        val_fraction: float = 0.1,
        test_fraction: float = 0.2,
        split_seed: int = 0,
    ) -> None:
        super().__init__()
        # Outside LightningCLI (which saves class_path + init_args), pickled datasets would need weights_only=False
        self.save_hyperparameters(ignore=None if built_by_cli() else ["train", "val", "test", "collate_fn"])
        self.datasets, self.collate_fn = {"train": train, "val": val, "test": test}, collate_fn
        self.class_names = _class_names(train, num_classes)
        # The count found, not None: Lightning refuses a module and a data module whose hparams differ on a key
        self.save_hyperparameters({**self.hparams, "num_classes": len(self.class_names)})
        shape = _attribute(train, "input_shape")
        self.input_shape = tuple(shape) if shape is not None else None
        self.in_channels = _attribute(train, "in_channels") or (shape[0] if shape is not None else None)
        self.labels_checked = False  # True once every label was checked (datasets with `targets`)

    def load(self) -> None:
        given, train = self.datasets, self.datasets["train"]
        fractions = self.fractions({name for name in ("val", "test") if given[name] is not None})
        carved = carve(_targets(train), len(train), fractions, self.hparams.split_seed)
        self.train_set = train if len(carved["train"]) == len(train) else Subset(train, carved["train"])
        self.val_set, self.test_set = (
            given[s] if given[s] is not None else Subset(train, carved[s]) for s in ("val", "test")
        )
        self.split_fingerprint = fingerprint([carved, {n: len(d) for n, d in given.items() if d is not None}])
        checked = []
        for name, dataset in ((name, d) for name, d in given.items() if d is not None):
            if self.collate_fn is None and len(dataset):
                _refuse_pil_images(dataset[0], dataset, name)
            if (targets := _targets(dataset)) is not None:
                check_labels(torch.as_tensor(targets), self.num_classes, f"The {name} dataset")
            checked.append(targets is not None)
        self.labels_checked = all(checked)

    def loader(self, split: str) -> DataLoader:
        hp, dataset = self.hparams, getattr(self, f"{split}_set")
        args = loader_args(self.trainer, hp.batch_size, hp.num_workers, hp.pin_memory, True, self.collate_fn)
        return (train_loader if split == "train" else eval_loader)(dataset, self.trainer, args)

    def describe_data(self) -> str:
        return f"the dataset {_qualified_name(self.datasets['train'])}"

    def state_dict(self) -> dict:
        # No `mean`: predict and export take image checkpoints only, and say so (project/inference.py).
        return super().state_dict() | {"dataset": _qualified_name(self.datasets["train"])}


def _attribute(dataset: Dataset, name: str):
    """dataset.<name>, looking through Subsets and other wrappers that keep the original as `.dataset`."""
    while dataset is not None and not hasattr(dataset, name):
        dataset = getattr(dataset, "dataset", None)
    return getattr(dataset, name, None)


def _refuse_pil_images(sample: Any, dataset: Dataset, name: str) -> None:
    """A PIL image (a torchvision dataset without a transform) would fail in the first batch's collate."""
    sample = list(sample.values()) if isinstance(sample, dict) else sample
    parts = sample if isinstance(sample, tuple | list) else [sample]
    if any(type(part).__module__.startswith("PIL.") for part in parts):
        raise ConfigError(
            f"The {name} dataset {_qualified_name(dataset)} yields PIL images, which torch's default collate cannot "
            f"batch. Give it a transform: --data.init_args.{name}.init_args.transform torchvision.transforms.ToTensor "
            f"(in the config, under data.init_args.{name}.init_args: transform: {{class_path: torchvision.transforms."
            "ToTensor}), or a collate_fn that batches PIL images."
        )


def _targets(dataset: Dataset) -> list[int] | None:
    if (targets := _attribute(dataset, "targets")) is None:
        return None
    targets = torch.as_tensor(targets).tolist()
    return [targets[i] for i in dataset.indices] if isinstance(dataset, Subset) else targets


def _class_names(dataset: Dataset, num_classes: int | None) -> list[str]:
    if (classes := _attribute(dataset, "classes")) is not None:
        if num_classes is not None and num_classes != len(classes):
            raise ConfigError(
                f"data.num_classes={num_classes}, but the train dataset {_qualified_name(dataset)} lists "
                f"{len(classes)} classes. Leave --data.init_args.num_classes unset (the dataset's count is used)."
            )
        return [str(c) for c in classes]
    if (count := num_classes if num_classes is not None else _attribute(dataset, "num_classes")) is None:
        raise ConfigError(
            f"How many classes does {_qualified_name(dataset)} have? It has no `classes` (class names) or "
            "`num_classes` attribute: set --data.init_args.num_classes N (data.init_args.num_classes in the "
            "config), or give the dataset a `classes` list."
        )
    return [str(i) for i in range(int(count))]


def _qualified_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"

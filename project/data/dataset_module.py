"""DatasetDataModule: any map-style torch Dataset (and its collate_fn), named by class_path in the config.

For data that is not images in folders: sequences, tabular rows, graphs, several inputs per sample. Batches are
(inputs, y) as the collate_fn makes them; `inputs` may be a tensor, a tuple or a dict, and the module calls the
model as model(x), model(*x) or model(**x) (project/module.py). What the image data module adds (input shape,
normalisation statistics, channels_last, the report's image panels, predict and export) is left out or degrades
with a message for such data.

Loaders: training through ResumableDataLoader (shuffled by (seed, epoch), drop_last, exact mid-epoch resume),
sharded per rank under DDP into equal, disjoint slices of each epoch's order (RankShard, rank_shard.py);
validation and test in order, every sample seen once across the ranks (UnrepeatedDistributedSampler), as in
project/data/datamodule.py.
"""

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Subset

from project.data.base import ClassificationData
from project.data.loaders import eval_loader, loader_args, train_loader
from project.data.resumable_loader import ResumableDataLoader
from project.data.splits import carve
from project.data.validate import check_batch_size, check_labels, check_split_sizes
from project.errors import ConfigError
from project.versions import built_by_cli


class DatasetDataModule(ClassificationData):
    """Your own map-style Datasets, their collate_fn, seeded splits and resumable, DDP-sharded loaders.

    Args:
        train: the training Dataset (`class_path` + `init_args` in the config, like the model). Samples are
            whatever your collate_fn turns into (inputs, label) batches; without a collate_fn, (input, label)
            pairs that torch's default collate stacks (tensors: a torchvision dataset needs its `transform`). The
            class_path may name a function annotated `-> Dataset` (TensorDataset's arguments are positional).
        val: the validation Dataset; None carves `val_fraction` of `train` out (stratified when the dataset has
            `targets`, else a seeded random split).
        test: the test Dataset; None carves `test_fraction` of `train` out, before val, the same way.
        collate_fn: turns a list of samples into one (inputs, labels) batch: an import path in the config
            (`collate_fn: my_data.pad_collate`), or a `class_path` of a callable class. None: torch's default.
        num_classes: the number of classes. None reads it from the train dataset: its `classes` (names; their
            count) or its `num_classes`.
        batch_size: samples per batch *per device*; the global batch is batch_size x devices x nodes.
        num_workers: loader worker processes per device; None picks one from the CPU and process count (as for a
            dataset that reads files). A dataset already in memory is fastest with 0.
        pin_memory: pin host memory for faster copies to the GPU; None means "when CUDA is available".
        val_fraction: share of the non-test data held out for validation when `val` is None.
        test_fraction: share of all data held out for test when `test` is None.
        split_seed: seed of the carved splits, independent of the training seed.

    Read from the train dataset when it has them: `classes` (class names, used by the report), `targets` (labels:
    stratified splits, and every label checked to be in range before training), `in_channels` (the CLI passes it
    to the model's `in_channels`), `input_shape` ((C, H, W) for image data: the model's output size is then checked
    on a dummy batch before training, and channels_last applies).
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
        # With LightningCLI the config is saved (the datasets as class_path + init_args); outside it, pickling the
        # datasets themselves into every checkpoint would make it unloadable with weights_only=True.
        from_cli = built_by_cli()
        self.save_hyperparameters(ignore=None if from_cli else ["train", "val", "test", "collate_fn"])
        if batch_size < 1:
            raise ConfigError(f"data.batch_size must be >= 1, got {batch_size}.")
        for name, fraction, given in (("val", val_fraction, val), ("test", test_fraction, test)):
            if given is None and not 0 < fraction < 1:
                raise ConfigError(
                    f"data.{name} is not set and data.{name}_fraction={fraction} is outside (0, 1): the {name} split "
                    f"is carved from the train dataset. Set --data.init_args.{name}_fraction to a value such as 0.1, "
                    f"or give a {name} dataset (data.init_args.{name}: class_path + init_args)."
                )
        self.datasets = {"train": train, "val": val, "test": test}
        self.collate_fn = collate_fn
        self.class_names = _class_names(train, num_classes)
        # The count found, not None: Lightning refuses a module and a data module whose hparams share a key
        # (num_classes) with different values, and the checkpoint rebuilds the same data module either way.
        self.save_hyperparameters({**self.hparams, "num_classes": len(self.class_names)})
        self.input_shape = _attribute(train, "input_shape")
        self.input_shape = tuple(self.input_shape) if self.input_shape is not None else None
        self.in_channels = _attribute(train, "in_channels")
        if self.in_channels is None and self.input_shape is not None:
            self.in_channels = self.input_shape[0]
        self.labels_checked = False  # True once every label was checked (datasets with `targets`)
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.test_set: Dataset | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        hp, given = self.hparams, self.datasets
        train = given["train"]
        wanted = {"test": hp.test_fraction, "val": hp.val_fraction}
        fractions = {name: f for name, f in wanted.items() if given[name] is None}
        carved = carve(_targets(train), len(train), fractions, hp.split_seed)
        index = carved["train"]
        self.train_set = train if len(index) == len(train) else Subset(train, index)
        self.val_set = given["val"] if given["val"] is not None else Subset(train, carved["val"])
        self.test_set = given["test"] if given["test"] is not None else Subset(train, carved["test"])
        checked = []
        for name, dataset in (("train", train), ("val", given["val"]), ("test", given["test"])):
            if dataset is None:
                continue
            if self.collate_fn is None and len(dataset):
                _refuse_images_collate_cannot_batch(dataset[0], dataset, name)
            targets = _targets(dataset)
            if targets is not None:
                check_labels(torch.as_tensor(targets), self.num_classes, f"The {name} dataset")
            checked.append(targets is not None)
        self.labels_checked = all(checked)
        sizes = {"train": len(self.train_set), "val": len(self.val_set), "test": len(self.test_set)}
        check_split_sizes(sizes, f"val_fraction={hp.val_fraction}, test_fraction={hp.test_fraction}")
        if stage in (None, "fit"):
            check_batch_size(sizes["train"], self.world_size(), hp.batch_size)

    def _args(self) -> dict[str, Any]:
        hp = self.hparams
        return loader_args(self.trainer, hp.batch_size, hp.num_workers, hp.pin_memory, True, self.collate_fn)

    def train_dataloader(self) -> ResumableDataLoader:
        return train_loader(self.train_set, self.trainer, self._args())

    def val_dataloader(self) -> DataLoader:
        return eval_loader(self.val_set, self.trainer, self._args())

    def test_dataloader(self) -> DataLoader:
        return eval_loader(self.test_set, self.trainer, self._args())

    def describe_data(self) -> str:
        return f"the dataset {_qualified_name(self.datasets['train'])}"

    def state_dict(self) -> dict:
        # The class names, for the report and a later test; no `mean`: predict and export take image checkpoints
        # only, and tell the user so (project/inference.py).
        return {"class_names": self.class_names, "dataset": _qualified_name(self.datasets["train"])}


def _attribute(dataset: Dataset, name: str):
    """dataset.<name>, looking through Subsets (and other wrappers that keep the original as `.dataset`)."""
    while dataset is not None:
        if hasattr(dataset, name):
            return getattr(dataset, name)
        dataset = getattr(dataset, "dataset", None)
    return None


def _refuse_images_collate_cannot_batch(sample: Any, dataset: Dataset, name: str) -> None:
    """Sample 0 of a dataset without a collate_fn holds a PIL image (a torchvision dataset without a transform):
    torch's default collate would fail inside the first batch, with a traceback."""
    if isinstance(sample, dict):
        sample = list(sample.values())
    parts = sample if isinstance(sample, tuple | list) else [sample]
    if any(type(part).__module__.startswith("PIL.") for part in parts):
        raise ConfigError(
            f"The {name} dataset {_qualified_name(dataset)} yields PIL images, which torch's default collate cannot "
            f"batch. Give the dataset a transform that makes tensors: in the config, under data.init_args.{name}."
            "init_args, transform: {class_path: torchvision.transforms.ToTensor} (several: torchvision.transforms."
            f"Compose); as a flag, --data.init_args.{name}.init_args.transform torchvision.transforms.ToTensor. Or "
            "give a collate_fn that batches PIL images (data.init_args.collate_fn)."
        )


def _targets(dataset: Dataset) -> list[int] | None:
    targets = _attribute(dataset, "targets")
    if targets is None:
        return None
    targets = torch.as_tensor(targets).tolist()
    if isinstance(dataset, Subset):  # the wrapped dataset's labels, for this subset's indices
        targets = [targets[i] for i in dataset.indices]
    return targets


def _class_names(dataset: Dataset, num_classes: int | None) -> list[str]:
    classes, declared = _attribute(dataset, "classes"), _attribute(dataset, "num_classes")
    if classes is not None:
        names = [str(c) for c in classes]
        if num_classes is not None and num_classes != len(names):
            raise ConfigError(
                f"data.num_classes={num_classes}, but the train dataset {_qualified_name(dataset)} lists "
                f"{len(names)} classes. Leave --data.init_args.num_classes unset (the dataset's count is used)."
            )
        return names
    count = num_classes if num_classes is not None else declared
    if count is None:
        raise ConfigError(
            f"How many classes does {_qualified_name(dataset)} have? It has no `classes` (class names) or "
            "`num_classes` attribute: set --data.init_args.num_classes N (data.init_args.num_classes in the "
            "config), or give the dataset a `classes` list."
        )
    if int(count) < 2:
        raise ConfigError(f"data.num_classes must be at least 2, got {count}.")
    return [str(i) for i in range(int(count))]


def _qualified_name(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"

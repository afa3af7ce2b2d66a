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

import copy
import math
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from lightning.pytorch.core.mixins.hparams_mixin import _given_hyperparameters
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from torch.utils.data import DataLoader, Dataset, Subset

from project.data.rank_shard import rank_shard
from project.data.resumable_loader import ResumableDataLoader
from project.data.tensor_dataset import stratified_split
from project.data.validate import check_batch_size, check_labels, check_split_sizes
from project.data.workers import default_num_workers
from project.errors import ConfigError
from project.rng import run_seed


class DatasetDataModule(L.LightningDataModule):
    """Your own map-style Datasets, their collate_fn, seeded splits and resumable, DDP-sharded loaders.

    Args:
        train: the training Dataset (`class_path` + `init_args` in the config, like the model). Samples are
            whatever your collate_fn turns into (inputs, label) batches; without a collate_fn, (input, label)
            pairs that torch's default collate stacks.
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
        from_cli = _given_hyperparameters.get() is not None
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
        self.hparams.num_classes = len(self.class_names)
        self._hparams_initial = copy.deepcopy(self._hparams)  # what Lightning compares and logs
        self.input_shape = _attribute(train, "input_shape")
        self.input_shape = tuple(self.input_shape) if self.input_shape is not None else None
        self.in_channels = _attribute(train, "in_channels")
        if self.in_channels is None and self.input_shape is not None:
            self.in_channels = self.input_shape[0]
        self.labels_checked = False  # True once every label was checked (datasets with `targets`)
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.test_set: Dataset | None = None

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def prepare_data(self) -> None:
        # As ImageClassificationDataModule: bad data fails before the loggers write the run directory.
        fn = self.trainer.state.fn if self.trainer is not None else None
        self.setup(fn.value if fn is not None else None)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        hp, given = self.hparams, self.datasets
        train = given["train"]
        index = list(range(len(train)))
        labels = _targets(train)
        carved = {}
        for name, fraction in (
            ("test", hp.test_fraction),
            ("val", hp.val_fraction),
        ):  # test first, as for images
            if given[name] is None:
                index, carved[name] = _carve(index, labels, fraction, hp.split_seed, name)
        self.train_set = train if len(index) == len(train) else Subset(train, index)
        self.val_set = given["val"] if given["val"] is not None else Subset(train, carved["val"])
        self.test_set = given["test"] if given["test"] is not None else Subset(train, carved["test"])
        checked = []
        for name, dataset in (("train", train), ("val", given["val"]), ("test", given["test"])):
            if dataset is None:
                continue
            targets = _targets(dataset)
            if targets is not None:
                check_labels(torch.as_tensor(targets), self.num_classes, f"The {name} dataset")
            checked.append(targets is not None)
        self.labels_checked = all(checked)
        sizes = {"train": len(self.train_set), "val": len(self.val_set), "test": len(self.test_set)}
        check_split_sizes(sizes, f"val_fraction={hp.val_fraction}, test_fraction={hp.test_fraction}")
        if stage in (None, "fit"):
            check_batch_size(sizes["train"], self._world()[1], hp.batch_size)

    def _world(self) -> tuple[int, int]:
        """(global rank, world size): (0, 1) without a Trainer."""
        return (self.trainer.global_rank, self.trainer.world_size) if self.trainer is not None else (0, 1)

    def _common(self) -> dict[str, Any]:
        hp = self.hparams
        workers = hp.num_workers
        if workers is None:
            workers = default_num_workers(True, self.trainer.num_devices if self.trainer is not None else 1)
        return dict(
            batch_size=hp.batch_size,
            num_workers=workers,
            pin_memory=hp.pin_memory if hp.pin_memory is not None else torch.cuda.is_available(),
            persistent_workers=workers > 0,
            collate_fn=self.collate_fn,
            generator=torch.Generator(),  # never the global RNG: see datamodule.py's _loader
        )

    def train_dataloader(self) -> ResumableDataLoader:
        check_batch_size(len(self.train_set), self._world()[1], self.hparams.batch_size)
        sampler = rank_shard(len(self.train_set), run_seed(), self.trainer)
        return ResumableDataLoader(self.train_set, seed=run_seed(), sampler=sampler, **self._common())

    def _eval_loader(self, dataset: Dataset) -> DataLoader:
        rank, world = self._world()
        # DDP: each sample on exactly one rank, so none is counted twice in val/test metrics (datamodule.py).
        sampler = UnrepeatedDistributedSampler(dataset, world, rank, shuffle=False) if world > 1 else None
        return DataLoader(dataset, shuffle=False, sampler=sampler, **self._common())

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader(self.val_set)

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader(self.test_set)

    def state_dict(self) -> dict:
        # The class names, for the report and a later test; no `mean`: predict and export take image checkpoints
        # only, and tell the user so (project/inference.py).
        return {"class_names": self.class_names, "dataset": _qualified_name(self.datasets["train"])}

    def load_state_dict(self, state: dict) -> None:
        if state.get("class_names") not in (None, self.class_names):
            raise ConfigError(
                f"The checkpoint was trained on classes {state['class_names']}, but the data has {self.class_names}."
            )


def _attribute(dataset: Dataset, name: str):
    """dataset.<name>, looking through Subsets (and other wrappers that keep the original as `.dataset`)."""
    while dataset is not None:
        if hasattr(dataset, name):
            return getattr(dataset, name)
        dataset = getattr(dataset, "dataset", None)
    return None


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


def _carve(
    index: list[int], labels: list[int] | None, fraction: float, seed: int, name: str
) -> tuple[list[int], list[int]]:
    """Hold out `fraction` of `index`: stratified by label when labels are known, else a seeded permutation."""
    if labels is not None:
        try:
            keep, held = stratified_split([labels[i] for i in index], fraction, seed)
        except ValueError as err:
            raise ConfigError(
                f"Cannot hold out a stratified {name} split (data.{name}_fraction={fraction}) from {len(index)} "
                f"samples: {err} Change --data.init_args.{name}_fraction, give a {name} dataset, or add data."
            ) from err
        return [index[i] for i in keep], [index[i] for i in held]
    order = torch.randperm(len(index), generator=torch.Generator().manual_seed(seed)).tolist()
    n_held = math.ceil(fraction * len(index))  # as stratified_split counts
    held = sorted(order[:n_held])
    held_set = set(held)
    return [index[i] for i in range(len(index)) if i not in held_set], [index[i] for i in held]


def _qualified_name(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"

"""ImageClassificationDataModule: the embedded digits, an ImageFolder, or torchvision's dataset files.

What this module decides is only where the samples come from (a tensor source or image files) and how they are
served (one tensor in memory, or a DataLoader). The rest is shared with the other data modules and `prepare`:
splits (project/data/splits.py), normalisation statistics (stats.py), resizing and normalisation (normalize.py),
augmentation (augment.py), loaders (loaders.py, in_memory.py), class names and checks (base.py, validate.py).
Both ways of serving a split give the same batches for the same seed: the same order (EpochSampler), the same
pixels, augmented and normalised by the same functions.
"""

import functools
import os
from typing import Literal

import torch
from torch.utils.data import DataLoader, Dataset

from project.data import digits, folder_index, image_folder, torchvision_datasets
from project.data.augment import Recipe, recipe_for
from project.data.base import ImageData
from project.data.decode import load_image_at
from project.data.image_files import ImageFiles
from project.data.in_memory import InMemoryLoader
from project.data.loaders import eval_loader, loader_args, train_loader, world
from project.data.normalize import resize
from project.data.splits import carve
from project.data.stats import STATS_LIMIT, tensor_stats, train_stats
from project.data.tensor_dataset import ImageTensorDataset
from project.data.validate import check_batch_size, check_labels, check_split_sizes, fail_unreadable
from project.errors import ConfigError
from project.rng import run_seed

Source = Literal["digits", "imagefolder", "cifar10", "mnist", "fashionmnist"]
SPLITS = ("train", "val", "test")


class ImageClassificationDataModule(ImageData):
    """Image classification data with stratified, seeded splits.

    Args:
        source: `digits` (embedded, no download), `imagefolder` (your images under `root`), or a torchvision
            dataset: `cifar10`, `mnist`, `fashionmnist`.
        root: data directory for every source but `digits`.
        download: let torchvision download its dataset into `root` when the files are absent (needs network).
        batch_size: samples per batch *per device*; the global batch is batch_size x devices x nodes.
        num_workers: loader worker processes per device; None picks one from the CPU count and process count.
        val_fraction: share of the non-test data held out for validation when there is no val split.
        test_fraction: share of all data held out for test when there is no test split (digits: 0.2).
        split_seed: seed of the train/val/test split, independent of the training seed.
        augment: the training augmentation recipe (project/data/augment.py): `affine` (small rotations, scales
            and shifts, no flips), `crop_flip` (random crop of a padded image + horizontal flip), `resized_crop`
            (random crop of 8-100% of the area, scaled back, + flip), or `none`; unset: the source's (affine for
            digits and MNIST, crop_flip for CIFAR-10, resized_crop for ImageFolder, none for FashionMNIST). The
            same recipe runs on every path.
        image_size: resize images to this square size; None keeps the native size (ImageFolder: the first
            training image's size).
        pin_memory: pin host memory for faster copies to the GPU; None means "when CUDA is available".
        in_memory: serve batches from the whole split held as one tensor on the training device
            (project/data/in_memory.py) instead of a DataLoader; the batches are the same either way. None: for
            tensor sources when the splits take under a quarter of the free (GPU) memory; never for ImageFolder, where
            true decodes every image into memory at setup.
    """

    def __init__(
        self,
        source: Source = "digits",
        root: str | None = None,
        download: bool = False,
        batch_size: int = 64,
        num_workers: int | None = None,
        val_fraction: float = 0.1,
        test_fraction: float = 0.2,
        split_seed: int = 0,
        augment: Recipe | None = None,
        image_size: int | None = None,
        pin_memory: bool | None = None,
        in_memory: bool | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if source != "digits" and root is None:
            raise ConfigError(f"data source '{source}' needs a directory: set --data.init_args.root.")
        if batch_size < 1:
            raise ConfigError(f"data.batch_size must be >= 1, got {batch_size}.")
        for name, fraction in (("val", val_fraction), ("test", test_fraction)):
            if not 0 <= fraction < 1:  # 1 would hold out every sample and leave the train split empty
                raise ConfigError(
                    f"data.{name}_fraction={fraction} is outside [0, 1): it is the share of the data held out for "
                    f"{name}, and {'1 or more leaves the train split empty' if fraction >= 1 else 'it cannot be negative'}. "
                    f"Set --data.init_args.{name}_fraction to a value such as 0.1."
                )
        self.recipe = recipe_for(augment, source)
        if source == "digits":
            self.class_names, (c, h, w) = list(digits.CLASSES), digits.INPUT_SHAPE
        elif source == "imagefolder":
            self.class_names, (h, w) = image_folder.describe(root)
            c = 3  # images are decoded to RGB
        else:
            self.class_names, (c, h, w) = (
                torchvision_datasets.classes_of(source),
                torchvision_datasets.DATASETS[source][1],
            )
        self.input_shape = (c, image_size, image_size) if image_size else (c, h, w)
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.test_set: Dataset | None = None
        # split -> (pixels at the training size, labels): what the in-memory path serves
        self.tensors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def describe_data(self) -> str:
        return f"the {self.hparams.source} data"

    @property
    def size(self) -> tuple[int, int]:
        return tuple(self.input_shape[1:])

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        hp = self.hparams
        if hp.source == "imagefolder":
            self._setup_image_folder()
        else:
            self._setup_tensors()
        sizes = {"train": len(self.train_set), "val": len(self.val_set), "test": len(self.test_set)}
        check_split_sizes(sizes, f"val_fraction={hp.val_fraction}, test_fraction={hp.test_fraction}")
        if stage in (None, "fit"):  # here too, not only in train_dataloader(): that runs after the logs exist
            check_batch_size(sizes["train"], self.world_size(), hp.batch_size)

    def _fractions(self, given: set[str]) -> dict[str, float]:
        """The splits to carve from the training pool: those the data does not have."""
        hp = self.hparams
        wanted = {"test": hp.test_fraction, "val": hp.val_fraction}
        return {name: f for name, f in wanted.items() if name not in given}

    def _setup_tensors(self) -> None:
        hp = self.hparams
        if hp.source == "digits":
            images, labels = digits.load_digits_tensors()
            given = {}
        else:
            images, labels = torchvision_datasets.load_split(hp.source, hp.root, True, hp.download)
            given = {"test": torchvision_datasets.load_split(hp.source, hp.root, False, hp.download)}
        # labels out of range fail before training, not at the first bad batch
        check_labels(labels, self.num_classes, f"The {hp.source} training data")
        for name, (_, split_labels) in given.items():
            check_labels(split_labels, self.num_classes, f"The {hp.source} {name} data")
        parts = carve(labels, len(labels), self._fractions(set(given)), hp.split_seed)
        images = resize(images, self.size)  # once, not per batch
        pools = {name: (images[idx], labels[idx]) for name, idx in parts.items()}
        pools.update({name: (resize(x, self.size), y) for name, (x, y) in given.items()})
        self.tensors = {name: pools[name] for name in SPLITS}
        self.mean, self.std = tensor_stats(self.tensors["train"][0])  # the training split only
        self.train_set, self.val_set, self.test_set = (ImageTensorDataset(*self.tensors[n]) for n in SPLITS)

    def _setup_image_folder(self) -> None:
        hp = self.hparams
        given = {name for name in ("val", "test") if os.path.isdir(os.path.join(hp.root, name))}
        fractions = self._fractions(given)
        pixels = functools.partial(load_image_at, size=self.size)  # a file as every path serves it

        def carved(train_files: list[tuple[str, int]]) -> dict[str, list[int]]:
            return carve([y for _, y in train_files], len(train_files), fractions, hp.split_seed)

        def stats(train_files: list[tuple[str, int]]) -> tuple[list[float], list[float]]:
            return train_stats(lambda i: pixels(train_files[i][0]), carved(train_files)["train"])

        # Indexed and checked once, on one process; later starts re-check only new or changed files, and the
        # statistics are recomputed only when the training files or what decides them changed (folder_index.py).
        index = folder_index.index_folder(
            hp.root,
            self.class_names,
            stats=stats,
            stats_key=f"train_stats v2 size={self.size} limit={STATS_LIMIT} carve={fractions} seed={hp.split_seed}",
        )
        for name, samples in index.samples.items():  # unreadable files fail before training, train first
            fail_unreadable(index.unreadable[name], len(samples), os.path.join(hp.root, name))
        self.mean, self.std = index.mean, index.std
        train_files = index.samples["train"]
        parts = carved(train_files)
        files = {name: index.samples[name] for name in given}
        files.update({name: [train_files[i] for i in idx] for name, idx in parts.items()})
        self.train_set, self.val_set, self.test_set = (
            ImageFiles(files[name], loader=pixels) for name in SPLITS
        )
        if hp.in_memory:  # decoded once, here: the in-memory path serves the same pixels as the files
            self.tensors = {
                name: (
                    torch.stack([pixels(path) for path, _ in files[name]]),
                    torch.tensor([y for _, y in files[name]], dtype=torch.long),
                )
                for name in SPLITS
            }

    def use_in_memory(self) -> bool:
        """The in-memory path when asked, or (unset) for tensor sources whose splits take under a quarter of the
        free memory, unless overfit_batches is on (it needs a DataLoader's sampler to turn shuffling off)."""
        if self.hparams.in_memory is not None:
            return self.hparams.in_memory
        if not self.tensors or getattr(self.trainer, "overfit_batches", 0):
            return False
        need = sum(x.numel() * x.element_size() for x, _ in self.tensors.values())
        device = self._device()
        if device.type == "cuda":
            free = torch.cuda.mem_get_info(device)[0]
        else:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 0
        return need < free / 4

    def _device(self) -> torch.device:
        return self.trainer.strategy.root_device if self.trainer is not None else torch.device("cpu")

    def _loader(self, split: str) -> DataLoader | InMemoryLoader:
        hp, train = self.hparams, split == "train"
        if self.use_in_memory():
            images, labels = self.tensors[split]
            rank, size = world(self.trainer)
            if train:
                check_batch_size(len(labels), size, hp.batch_size)
            # the same seed on every rank: the shards are disjoint
            return InMemoryLoader(
                images, labels, hp.batch_size, shuffle=train, seed=run_seed(), rank=rank, world_size=size,
                device=self._device(),
            )  # fmt: skip
        dataset = {"train": self.train_set, "val": self.val_set, "test": self.test_set}[split]
        reads_files = hp.source == "imagefolder"
        args = loader_args(self.trainer, hp.batch_size, hp.num_workers, hp.pin_memory, reads_files)
        return (
            train_loader(dataset, self.trainer, args) if train else eval_loader(dataset, self.trainer, args)
        )

    def train_dataloader(self) -> DataLoader | InMemoryLoader:
        return self._loader("train")

    def val_dataloader(self) -> DataLoader | InMemoryLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader | InMemoryLoader:
        return self._loader("test")

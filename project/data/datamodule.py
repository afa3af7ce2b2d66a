"""ImageClassificationDataModule: the embedded digits, an ImageFolder, or torchvision's dataset files. It decides
only where the samples come from and are held (files read by loader workers, or tensors); the rest is shared."""

import functools
import os
import warnings
from typing import Literal

import torch
from torch.utils.data import DataLoader

from project.data import digits, folder_index, image_folder, torchvision_datasets
from project.data.augment import Recipe, recipe_for
from project.data.base import ImageData, fingerprint
from project.data.loaders import TensorImages, batched, eval_loader, loader_args, train_loader
from project.data.normalize import STATS_LIMIT, resize, tensor_stats, train_stats
from project.data.splits import carve
from project.data.validate import check_labels, fail_unreadable
from project.errors import ConfigError

Source = Literal["digits", "imagefolder", "cifar10", "mnist", "fashionmnist"]
SPLITS = ("train", "val", "test")


class ImageClassificationDataModule(ImageData):
    """Image classification data with stratified, seeded splits.

    Args:
        source: `digits` (embedded), `imagefolder` (your images under `root`), `cifar10`, `mnist`, `fashionmnist`.
        root: data directory for every source but `digits`.
        download: let torchvision download its dataset into `root` when the files are absent (needs network).
        batch_size: samples per batch *per device*; the global batch is batch_size x devices x nodes.
        num_workers: loader worker processes per device; None picks one from the CPU and process count.
        val_fraction: share of the non-test data held out for validation when there is no val split.
        test_fraction: share of all data held out for test when there is no test split.
        split_seed: seed of the train/val/test split, independent of the training seed.
        augment: the training augmentation (augment.py): `affine`, `crop_flip`, `resized_crop`, `none`; unset:
            the source's.
        image_size: resize images to this square size; None keeps the native size (ImageFolder: the first image's).
        pin_memory: pin host memory for faster copies to the GPU; None: when CUDA is available.
        in_memory: digits and torchvision sources: hold each split as one tensor on the training device; false:
            a DataLoader over host tensors (the same batches). ImageFolder files are always read by a DataLoader.
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
        in_memory: bool = True,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if source != "digits" and root is None:
            raise ConfigError(f"data source '{source}' needs a directory: set --data.init_args.root.")
        self.recipe = recipe_for(augment, source)
        if source == "digits":
            self.class_names, (c, h, w) = list(digits.CLASSES), digits.INPUT_SHAPE
        elif source == "imagefolder":
            self.class_names, (h, w) = image_folder.describe(root)
            c = 3  # images are decoded to RGB
        else:
            self.class_names = torchvision_datasets.classes_of(source)
            c, h, w = torchvision_datasets.DATASETS[source][1]
        self.input_shape = (c, image_size, image_size) if image_size else (c, h, w)
        self.tensors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # split -> (pixels, labels)

    def describe_data(self) -> str:
        return f"the {self.hparams.source} data"

    def load(self) -> None:
        if self.hparams.source == "imagefolder":
            return self._load_image_folder()
        hp = self.hparams
        tv = lambda train: torchvision_datasets.load_split(hp.source, hp.root, train, hp.download)  # noqa: E731
        images, labels = digits.load_digits_tensors() if hp.source == "digits" else tv(True)
        given = {} if hp.source == "digits" else {"test": tv(False)}
        for name, (_, y) in {"training": (images, labels), **given}.items():  # fail here, not at a bad batch
            check_labels(y, self.num_classes, f"The {hp.source} {name} data")
        parts = carve(labels, len(labels), self.fractions(set(given)), hp.split_seed)
        images = resize(images, self.input_shape[1:])  # once, not per batch
        pools = {name: (images[idx], labels[idx]) for name, idx in parts.items()}
        pools.update({name: (resize(x, self.input_shape[1:]), y) for name, (x, y) in given.items()})
        self.tensors = {name: pools[name] for name in SPLITS}
        self.mean, self.std = tensor_stats(self.tensors["train"][0])  # the training split only
        self.train_set, self.val_set, self.test_set = (TensorImages(*self.tensors[n]) for n in SPLITS)
        self.split_fingerprint = fingerprint([hp.source, parts, sorted(given)])

    def _load_image_folder(self) -> None:
        hp = self.hparams
        given = {name for name in ("val", "test") if os.path.isdir(os.path.join(hp.root, name))}
        fractions = self.fractions(given)
        pixels = functools.partial(image_folder.load_image_at, size=self.input_shape[1:])

        def carved(train_files: list[tuple[str, int]]) -> dict[str, list[int]]:
            return carve([y for _, y in train_files], len(train_files), fractions, hp.split_seed)

        def stats(train_files: list[tuple[str, int]]) -> tuple[list[float], list[float]]:
            return train_stats(lambda i: pixels(train_files[i][0]), carved(train_files)["train"])

        key = f"train_stats v2 size={self.input_shape[1:]} limit={STATS_LIMIT} carve={fractions} seed={hp.split_seed}"
        index = folder_index.index_folder(hp.root, self.class_names, stats, key)
        for name, samples in index.samples.items():  # unreadable files fail before training, train first
            fail_unreadable(index.unreadable[name], len(samples), os.path.join(hp.root, name))
        self.mean, self.std = index.mean, index.std
        train_files = index.samples["train"]
        files = {name: index.samples[name] for name in given}
        files.update({name: [train_files[i] for i in idx] for name, idx in carved(train_files).items()})
        self.train_set, self.val_set, self.test_set = (
            image_folder.ImageFiles(files[n], pixels) for n in SPLITS
        )
        # the files relative to root: the same folder moved elsewhere is the same data
        self.split_fingerprint = fingerprint(
            {n: [(os.path.relpath(p, hp.root), y) for p, y in files[n]] for n in SPLITS}
        )

    def loader(self, split: str) -> DataLoader:
        hp, trainer = self.hparams, self.trainer
        if self.tensors and hp.in_memory:  # on the device: no workers, nothing to pin
            # Lightning's hint to add workers does not apply: they would only carry the batches
            warnings.filterwarnings("ignore", message=r"The '\w+_dataloader' does not have many workers")
            device = trainer.strategy.root_device if trainer is not None else torch.device("cpu")
            dataset = TensorImages(*(t.to(device) for t in self.tensors[split]))
            args = loader_args(trainer, hp.batch_size, 0, False, False, batched)
        else:
            dataset, files = getattr(self, f"{split}_set"), not self.tensors
            args = loader_args(
                trainer, hp.batch_size, hp.num_workers, hp.pin_memory, files, None if files else batched
            )
        return (train_loader if split == "train" else eval_loader)(dataset, trainer, args)

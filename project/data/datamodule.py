"""ImageClassificationDataModule: splits, transforms and loaders for every data source."""

import os
from typing import Literal

import lightning as L
import torch
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from torch.utils.data import DataLoader, Dataset, Subset

from project.data import digits, folder_index, image_folder, torchvision_datasets
from project.data.decode import load_image
from project.data.image_files import ImageFiles
from project.data.in_memory import InMemoryLoader
from project.data.normalize import Normalize
from project.data.rank_shard import rank_shard
from project.data.resumable_loader import ResumableDataLoader
from project.data.tensor_dataset import ImageTensorDataset, stratified_split
from project.data.transforms import build_transform, channel_stats, image_folder_transform
from project.data.validate import check_batch_size, check_labels, check_split_sizes, fail_unreadable
from project.data.workers import default_num_workers
from project.errors import ConfigError
from project.rng import run_seed

Source = Literal["digits", "imagefolder", "cifar10", "mnist", "fashionmnist"]
# ImageFolder: normalisation statistics from at most this many evenly spaced training images
STATS_LIMIT = 512


class ImageClassificationDataModule(L.LightningDataModule):
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
        augment: apply the source's training augmentation (shifts for digits, crop + flip for photos).
        image_size: resize images to this square size; None keeps the native size (ImageFolder: the first
            training image's size).
        pin_memory: pin host memory for faster copies to the GPU; None means "when CUDA is available".
        in_memory: serve batches from the whole split held as one tensor on the training device, augmented
            a batch at a time (project/data/in_memory.py); None = whenever the source is not ImageFolder and
            the splits take under a quarter of the free (GPU) memory. False forces the DataLoader path.
    """

    # Every label is checked to be in [0, num_classes) in setup (project/data/validate.py; ImageFolder labels
    # are folder indices), so ClassificationModule turns off torchmetrics' per-batch checks under this module.
    labels_checked = True

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
        augment: bool = True,
        image_size: int | None = None,
        pin_memory: bool | None = None,
        in_memory: bool | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if source != "digits" and root is None:
            raise ConfigError(f"data source '{source}' needs a directory: set --data.init_args.root.")
        if in_memory and source == "imagefolder":
            raise ConfigError(
                "data.in_memory=true needs images already decoded into a tensor; ImageFolder decodes files per "
                "sample. Set --data.init_args.in_memory false (or leave it unset) for source imagefolder."
            )
        if batch_size < 1:
            raise ConfigError(f"data.batch_size must be >= 1, got {batch_size}.")
        for name, fraction in (("val", val_fraction), ("test", test_fraction)):
            if not 0 <= fraction < 1:  # 1 would hold out every sample and leave the train split empty
                raise ConfigError(
                    f"data.{name}_fraction={fraction} is outside [0, 1): it is the share of the data held out for "
                    f"{name}, and {'1 or more leaves the train split empty' if fraction >= 1 else 'it cannot be negative'}. "
                    f"Set --data.init_args.{name}_fraction to a value such as 0.1."
                )
        if source == "digits":
            self.class_names, (c, h, w) = list(digits.CLASSES), digits.INPUT_SHAPE
        elif source == "imagefolder":
            self.class_names, (h, w) = image_folder.describe(root)
            c = 3  # ImageFolder's loader converts every image to RGB
        else:
            self.class_names, (c, h, w) = (
                torchvision_datasets.classes_of(source),
                torchvision_datasets.DATASETS[source][1],
            )
        self.input_shape = (c, image_size, image_size) if image_size else (c, h, w)
        self.mean: list[float] | None = None
        self.std: list[float] | None = None
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.test_set: Dataset | None = None
        # split -> (images, labels), in-memory path
        self.tensors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.policy = "none"
        self._normalize: Normalize | None = None  # ImageFolder's per-batch normalisation, built at first use

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def in_channels(self) -> int:
        return self.input_shape[0]

    def prepare_data(self) -> None:
        # Bad data fails before anything is written (README "Bad input": no run directory is left behind).
        # Lightning creates the loggers' files in the run directory between prepare_data and setup, so the data
        # is loaded and checked here, on the first process of each node; setup() keeps what it loaded, and the
        # other processes load theirs in setup().
        fn = self.trainer.state.fn if self.trainer is not None else None
        self.setup(fn.value if fn is not None else None)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        hp = self.hparams
        if hp.source == "imagefolder":
            self._setup_image_folder()
            self._check_split_sizes(stage)
            return
        if hp.source == "digits":
            images, labels = digits.load_digits_tensors()
            rest, test_idx = _stratified(labels, hp.test_fraction, hp.split_seed, "test")
            test_images, test_labels = images[test_idx], labels[test_idx]
            images, labels = images[rest], labels[rest]
        else:
            images, labels = torchvision_datasets.load_split(hp.source, hp.root, True, hp.download)
            test_images, test_labels = torchvision_datasets.load_split(hp.source, hp.root, False, hp.download)
        # labels out of range fail before training, not at the first bad batch
        check_labels(labels, self.num_classes, f"The {hp.source} training data")
        check_labels(test_labels, self.num_classes, f"The {hp.source} test data")
        train_idx, val_idx = _stratified(labels, hp.val_fraction, hp.split_seed, "val")
        self.mean, self.std = channel_stats(images[train_idx])  # statistics of the training split only
        policy = (
            "digits"
            if hp.source in ("digits", "mnist")
            else "none"
            if hp.source == "fashionmnist"
            else "natural"
        )
        self.policy = policy if hp.augment else "none"
        self.tensors = {
            "train": (images[train_idx], labels[train_idx]),
            "val": (images[val_idx], labels[val_idx]),
            "test": (test_images, test_labels),
        }
        if hp.image_size and tuple(images.shape[-2:]) != (hp.image_size,) * 2:  # resize once, not per batch
            self.tensors = {k: (_resize(x, hp.image_size), y) for k, (x, y) in self.tensors.items()}
        train_tf, eval_tf = self._transforms(policy)
        self.train_set = ImageTensorDataset(images[train_idx], labels[train_idx], train_tf)
        self.val_set = ImageTensorDataset(images[val_idx], labels[val_idx], eval_tf)
        self.test_set = ImageTensorDataset(test_images, test_labels, eval_tf)
        self._check_split_sizes(stage)

    def _check_split_sizes(self, stage: str | None) -> None:
        """An empty split or a batch larger than the training split fails now, not at the end of an epoch."""
        hp = self.hparams
        sizes = {"train": len(self.train_set), "val": len(self.val_set), "test": len(self.test_set)}
        check_split_sizes(sizes, f"val_fraction={hp.val_fraction}, test_fraction={hp.test_fraction}")
        if stage in (None, "fit"):  # here too, not only in train_dataloader(): that runs after the logs exist
            check_batch_size(sizes["train"], self._world_size(), hp.batch_size)

    def _world_size(self) -> int:
        return self.trainer.world_size if self.trainer is not None else 1

    def _transforms(self, policy: str):
        size = (self.hparams.image_size,) * 2 if self.hparams.image_size else None
        train_tf = build_transform(
            policy, self.mean, self.std, train=True, augment=self.hparams.augment, size=size
        )
        return train_tf, build_transform(policy, self.mean, self.std, train=False, augment=False, size=size)

    def _setup_image_folder(self) -> None:
        hp, size = self.hparams, self.input_shape[1:]
        # the evaluation transform, unnormalised: pixels in [0, 1] as training and evaluation see them
        stats_tf = image_folder_transform(train=False, augment=False, size=size)
        # Indexed and checked once, on one process; later starts re-check only new or changed files, and the
        # statistics are recomputed only when the training files changed (project/data/folder_index.py).
        index = folder_index.index_folder(
            hp.root,
            self.class_names,
            stats=lambda samples: _folder_stats(ImageFiles(samples, stats_tf, load_image)),
            stats_key=f"folder_stats v1 size={size[0]}x{size[1]} limit={STATS_LIMIT}",
        )
        for name, samples in index.samples.items():  # unreadable files fail before training, train first
            fail_unreadable(index.unreadable[name], len(samples), os.path.join(hp.root, name))
        self.mean, self.std = index.mean, index.std
        # Pixels, not normalised: on_after_batch_transfer normalises whole batches on the device.
        train_tf, eval_tf = (
            image_folder_transform(train=t, augment=hp.augment, size=size) for t in (True, False)
        )
        train_aug = ImageFiles(index.samples["train"], train_tf, load_image)
        train_eval = ImageFiles(index.samples["train"], eval_tf, load_image)
        labels = train_aug.targets
        kept = list(range(len(labels)))
        held_out = {}
        for name, fraction in (("test", hp.test_fraction), ("val", hp.val_fraction)):  # test first, as before
            if name in index.samples:
                held_out[name] = ImageFiles(index.samples[name], eval_tf, load_image)
            else:  # no <root>/<name>: carved from train, stratified
                kept, held = _carve(labels, kept, fraction, hp.split_seed, name)
                held_out[name] = Subset(train_eval, held)
        self.train_set, self.val_set, self.test_set = (
            Subset(train_aug, kept),
            held_out["val"],
            held_out["test"],
        )

    def _loader(self, dataset: Dataset, train: bool) -> DataLoader:
        workers = self.hparams.num_workers
        if workers is None:
            local_processes = self.trainer.num_devices if self.trainer is not None else 1
            workers = default_num_workers(not isinstance(dataset, ImageTensorDataset), local_processes)
        pin = self.hparams.pin_memory if self.hparams.pin_memory is not None else torch.cuda.is_available()
        if train:
            check_batch_size(len(dataset), self._world_size(), self.hparams.batch_size)
        common = dict(
            batch_size=self.hparams.batch_size,
            num_workers=workers,
            pin_memory=pin,  # Lightning copies pinned batches to the GPU with non_blocking=True
            persistent_workers=workers > 0,
            prefetch_factor=2 if workers > 0 else None,
            # Own generator: creating an iterator then never draws from the global RNG, so validation
            # cannot shift the training augmentation stream (an exact resume, and the same run for a seed).
            generator=torch.Generator(),
        )
        if train:
            # Shuffled, drop_last (equal-size steps keep BatchNorm stable and every DDP rank in lockstep), and
            # resumable mid-epoch: its position is saved in checkpoints (resumable_loader.py). Under DDP each rank
            # gets its equal, disjoint slice of the epoch's order from a RankShard, a DistributedSampler that
            # Lightning keeps instead of wrapping the loader's sampler (rank_shard.py says why).
            sampler = rank_shard(len(dataset), run_seed(), self.trainer)
            return ResumableDataLoader(dataset, seed=run_seed(), sampler=sampler, **common)
        sampler = None
        if self.trainer is not None and self.trainer.world_size > 1:
            # DDP: Lightning's default DistributedSampler pads the last shard with repeated samples so all ranks
            # run equally many batches, and those repeats would be counted twice in val/test metrics. This
            # sampler gives each sample to exactly one rank (shards differ by at most one sample); that is safe
            # in evaluation, where DDP syncs buffers on the first batch only. Lightning keeps a loader's own
            # DistributedSampler.
            sampler = UnrepeatedDistributedSampler(
                dataset, num_replicas=self.trainer.world_size, rank=self.trainer.global_rank, shuffle=False
            )
        return DataLoader(dataset, shuffle=False, sampler=sampler, **common)

    def use_in_memory(self) -> bool:
        """The in-memory path unless forced off, for ImageFolder, overfit_batches (needs a DataLoader's
        sampler to turn shuffling off), or splits larger than a quarter of the free memory."""
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

    def _in_memory_loader(self, split: str, train: bool) -> InMemoryLoader:
        images, labels = self.tensors[split]
        rank, world = (
            (self.trainer.global_rank, self.trainer.world_size) if self.trainer is not None else (0, 1)
        )
        if train:
            check_batch_size(len(labels), world, self.hparams.batch_size)
        return InMemoryLoader(
            images,
            labels,
            self.hparams.batch_size,
            self.mean,
            self.std,
            shuffle=train,
            augment=self.policy if train else "none",
            seed=run_seed(),  # the same on every rank: the shards are disjoint
            rank=rank,
            world_size=world,
            device=self._device(),
        )

    def transfer_batch_to_device(self, batch, device: torch.device, dataloader_idx: int):
        # The in-memory loader builds batches on the training device already: skip Lightning's generic walk
        # over the batch (~0.15 ms a step on 2 CPU cores, ~1% of a digits step). Anything else is moved as usual.
        # (Here, not in the LightningModule: Lightning warns when a module overrides it next to a data module.)
        if isinstance(batch, (tuple, list)) and all(
            isinstance(t, torch.Tensor) and t.device == device for t in batch
        ):
            return batch
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        # ImageFolder batches arrive as pixels (uint8 crops, or float in [0, 1] after an evaluation resize) and
        # are normalised here, once per batch, on the training device (project/data/normalize.py: the function
        # predict and export use too). The other sources' loaders normalise already.
        if self.hparams.source == "imagefolder" and self.mean is not None:
            if self._normalize is None:
                self._normalize = Normalize(self.mean, self.std)
            x, y = batch
            return self._normalize(x), y
        return batch

    def train_dataloader(self) -> DataLoader | InMemoryLoader:
        if self.use_in_memory():
            return self._in_memory_loader("train", train=True)
        return self._loader(self.train_set, train=True)

    def val_dataloader(self) -> DataLoader | InMemoryLoader:
        if self.use_in_memory():
            return self._in_memory_loader("val", train=False)
        return self._loader(self.val_set, train=False)

    def test_dataloader(self) -> DataLoader | InMemoryLoader:
        if self.use_in_memory():
            return self._in_memory_loader("test", train=False)
        return self._loader(self.test_set, train=False)

    def state_dict(self) -> dict:
        # Saved in every checkpoint so prediction and export know the classes and the preprocessing.
        return {
            "class_names": self.class_names,
            "mean": self.mean,
            "std": self.std,
            "input_shape": list(self.input_shape),
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("class_names") not in (None, self.class_names):
            raise ConfigError(
                f"The checkpoint was trained on classes {state['class_names']}, but the data has {self.class_names}."
            )


def _resize(images: torch.Tensor, size: int) -> torch.Tensor:
    x = images.float() / 255.0 if images.dtype == torch.uint8 else images.float()
    return torch.nn.functional.interpolate(x, size=(size, size), mode="bilinear", antialias=True).clamp_(0, 1)


def _stratified(labels, fraction: float, seed: int, name: str) -> tuple[list[int], list[int]]:
    """stratified_split, with its ValueError (too few samples per class or on one side) as a ConfigError."""
    try:
        return stratified_split(labels, fraction, seed)
    except ValueError as err:
        raise ConfigError(
            f"Cannot hold out a stratified {name} split (data.{name}_fraction={fraction}) from {len(labels)} samples: {err} "
            f"Change --data.init_args.{name}_fraction, or add data."
        ) from err


def _carve(
    labels: list[int], index: list[int], fraction: float, seed: int, name: str
) -> tuple[list[int], list[int]]:
    if fraction <= 0:
        raise ConfigError(
            f"There is no {name} folder and data.{name}_fraction is 0: add the folder or a fraction "
            f"(--data.init_args.{name}_fraction)."
        )
    keep, held = _stratified([labels[i] for i in index], fraction, seed, name)
    return [index[i] for i in keep], [index[i] for i in held]


def _folder_stats(dataset: Dataset, limit: int = STATS_LIMIT) -> tuple[list[float], list[float]]:
    step = max(1, len(dataset) // limit)
    images = torch.stack([dataset[i][0] for i in range(0, len(dataset), step)])
    return channel_stats(images)

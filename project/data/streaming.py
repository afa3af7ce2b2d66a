"""StreamingDataModule: training from litdata chunks (`python -m project prepare`), local or in object storage.

For data that does not fit one machine's memory or disk: litdata's StreamingDataset reads the chunk files of
each split (downloading them into a local cache when `input_dir` is an s3:// URL) and StreamingDataLoader
batches them. The images were resized to the training size and stored as uint8 by prepare, so a sample costs a
read, no decode; batches are converted to float, augmented (training only) and normalised after they reach the
training device (`on_after_batch_transfer`), a whole batch at a time.

What litdata does and what this module relies on or corrects (litdata 0.2.76):
- Sharding: each StreamingDataset detects the process group (rank, world size) and gives each rank and each
  loader worker its own chunks/intervals; Lightning injects no sampler into an IterableDataset.
- Training: shuffled (chunk order, then samples within a chunk window) with seed + epoch: the loader takes the
  epoch from the trainer (litdata's loader counts its own `iter()` calls, which restart from the first epoch when
  a run resumes from an epoch's end) and calls `dataset.set_epoch`, so every epoch has a new order. drop_last: every rank and worker gets the same number of
  full batches (DDP ranks stay in lockstep); the remainder is left out that epoch. Loader workers are persistent: they
  read the same batches each epoch as fresh ones (checked over 3 epochs), and a mid-epoch resume under DDP ends
  bit-identical with them (tests/test_streaming_ddp.py: one worker per rank).
- Validation and test: litdata turns drop_last on by itself under DDP (it would leave samples out of the
  metrics); here it is off, and then litdata gives the remainder to the last rank instead of padding, so every
  sample is counted exactly once (ranks may run different numbers of evaluation batches, which is safe: the
  metrics are synced once, at epoch end).
- Resume: StreamingDataLoader has `state_dict()`/`load_state_dict()` (samples yielded, epoch), which Lightning
  saves in every checkpoint for a training loader that has them and restores before a resumed mid-epoch.
- Checks: before a run, each split's index.json against prepare.json and, for a local directory, each chunk
  file's size and header against the index (project/data/chunks.py `check_split`).
"""

import logging
import math
import os
import warnings

import torch
from lightning.pytorch.utilities import rank_zero_warn

from project.data.augment import Recipe, recipe_for
from project.data.base import ImageData
from project.data.chunks import MIN_CHUNKS, allow_plain_http, check_split, join, read_metadata, rewrite_hint
from project.data.loaders import loader_args
from project.data.validate import check_batch_size
from project.errors import ConfigError
from project.rng import run_seed


class StreamingDataModule(ImageData):
    """Image classification from a dataset written by `python -m project prepare`.

    Args:
        input_dir: what prepare wrote: a local directory or an object-store URL (s3://bucket/prefix).
        batch_size: samples per batch *per device*; the global batch is batch_size x devices x nodes.
        num_workers: loader worker processes per device; None picks one from the CPU count and process count.
        augment: the training augmentation recipe (`affine`, `crop_flip`, `resized_crop`, `none`;
            project/data/augment.py), the image module's; unset: the prepared source's (affine for digits and
            MNIST, crop_flip for CIFAR-10, resized_crop for ImageFolder, none for FashionMNIST). The same recipe,
            code and seeds as on the image module's paths.
        shuffle: shuffle the training split (a new order each epoch); False reads it in stored order.
        image_size: the size the data was prepared at (None accepts it); a different size is an error that
            names the prepare command, not a silent mismatch with the model.
        pin_memory: pin host memory for faster copies to the GPU; None means "when CUDA is available".
        cache_dir: where chunks of a remote input_dir are cached (litdata's default when None).
        max_cache_size: cache budget on disk, e.g. "50GB" (None: litdata's default).
        storage_options: passed to litdata (boto3's client arguments for s3://, e.g. endpoint_url); None uses
            the AWS_* environment variables.
    """

    def __init__(
        self,
        input_dir: str,
        batch_size: int = 64,
        num_workers: int | None = None,
        augment: Recipe | None = None,
        shuffle: bool = True,
        image_size: int | None = None,
        pin_memory: bool | None = None,
        cache_dir: str | None = None,
        max_cache_size: str | None = None,
        storage_options: dict | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if batch_size < 1:
            raise ConfigError(f"data.batch_size must be >= 1, got {batch_size}.")
        os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")  # no PyPI request per StreamingDataset
        # Lightning warns that an IterableDataset's __len__ "could be inaccurate" with several workers unless each
        # worker is configured to avoid duplicates: litdata gives each worker its own samples (tests/
        # test_streaming.py counts every one), so the warning does not apply to these loaders.
        warnings.filterwarnings("ignore", message=r"Your `IterableDataset` has `__len__` defined")
        # torch's "The given buffer is not writable": litdata reads each sample as a view of the chunk file's
        # buffer; collate stacks the views into a new tensor, so nothing ever writes into the file's memory.
        warnings.filterwarnings("ignore", message=r"The given buffer is not writable")
        if "://" not in input_dir:
            input_dir = os.path.abspath(input_dir)  # the same files whatever the working directory
        self.input_dir = input_dir
        meta = read_metadata(input_dir, storage_options)
        self.meta = meta
        self.class_names: list[str] = list(meta["class_names"])
        self.input_shape = tuple(meta["input_shape"])
        if image_size is not None and tuple(self.input_shape[1:]) != (image_size, image_size):
            raise ConfigError(
                f"'{input_dir}' was prepared at {self.input_shape[1]}x{self.input_shape[2]} pixels, not "
                f"data.image_size={image_size}. Prepare it at that size (python -m project prepare ... "
                f"--image_size {image_size} --output_dir <new dir>) or leave data.image_size unset."
            )
        self.mean: list[float] = list(meta["mean"])
        self.std: list[float] = list(meta["std"])
        self.recipe = recipe_for(augment, meta["source"])
        self.split_sizes: dict[str, int] = dict(meta["splits"])
        self._checked: set[str] = set()  # the splits check_split has passed

    def setup(self, stage: str | None = None) -> None:
        if stage in (None, "fit"):
            check_batch_size(self.split_sizes["train"], self.world_size(), self.hparams.batch_size)
        splits = {
            None: ("train", "val", "test"),
            "fit": ("train", "val"),
            "validate": ("val",),
            "test": ("test",),
        }
        for split in splits.get(stage, ()):
            if split not in self._checked:
                # index.json against prepare.json, and (local) each chunk file's size and header against the index:
                # a deleted, truncated or overwritten file is named here, not by a loader worker mid-epoch
                chunks = check_split(self.input_dir, split, self.meta, self.hparams.storage_options)
                self._checked.add(split)
                if split == "train" and chunks < min(MIN_CHUNKS, self.split_sizes["train"]):
                    rank_zero_warn(
                        f"'{join(self.input_dir, split)}' is stored as {chunks} chunk files, fewer than {MIN_CHUNKS}: "
                        "litdata shuffles and shards it chunk by chunk, so every epoch each process reads nearly "
                        "the same share and the same samples are left out. Write it again with the default chunks: "
                        f"{rewrite_hint(self.meta, self.input_dir)}."
                    )

    def _training_epoch(self) -> int:
        return self.trainer.current_epoch

    def _loader(self, split: str, train: bool):
        from litdata import StreamingDataset

        from project.data.stream_loader import BlockLoader, batches_per_block

        hp = self.hparams
        if "://" in self.input_dir:
            allow_plain_http(hp.storage_options)
        # the worker count and pinning every loader of this project gets (project/data/loaders.py)
        common = loader_args(self.trainer, hp.batch_size, hp.num_workers, hp.pin_memory, reads_files=True)
        workers, pin = common["num_workers"], common["pin_memory"]
        kwargs = dict(storage_options=hp.storage_options, max_cache_size=hp.max_cache_size)
        if hp.cache_dir is not None:
            kwargs["cache_dir"] = hp.cache_dir
        # drop_last=False under DDP: litdata logs that it "may lead to training interruptions"; that is about
        # training steps, and evaluation runs no collective per step. Kept out of the console here.
        log = logging.getLogger("litdata.streaming.dataset")
        level = log.level
        log.setLevel(logging.ERROR)
        try:
            dataset = StreamingDataset(
                join(self.input_dir, split),
                shuffle=train and hp.shuffle,
                drop_last=train,
                # the same on every rank (the shards are disjoint); litdata seeds numpy's RandomState, < 2**32
                seed=run_seed() % 2**32,
                # Deserialize the requested sample only. litdata's "auto" picks a window of 32 rows for small
                # uint8 tensors, and with the in-chunk shuffle (blocks of 256) nearly every read decoded a new
                # window for one row: 0.47 CPU ms per digits sample instead of 0.024 (one loader worker).
                batch_decode=1,
                **kwargs,
            )
        finally:
            log.setLevel(level)
        # Small training batches leave the workers in blocks of k (project/data/stream_loader.py).
        batch_bytes = hp.batch_size * (math.prod(self.input_shape) + 8)  # uint8 images, int64 labels
        k = batches_per_block(dataset, workers, hp.batch_size, batch_bytes) if train else 1
        return BlockLoader(
            dataset,
            # The trainer's epoch, not the loader's own count: resumed from an epoch's end, Lightning does not
            # restore the loader's state, and the count would start again at the first epoch's order.
            epoch=self._training_epoch if train and self.trainer is not None else None,
            fix=f"Write the dataset again: {rewrite_hint(self.meta, self.input_dir)}.",
            batch_size=hp.batch_size,
            batches_per_block=k,
            prestart=train and workers > 0,  # the next epoch's first batches read during validation
            num_workers=workers,
            pin_memory=pin,  # Lightning copies pinned batches to the GPU with non_blocking=True
            drop_last=train,
            # Workers kept from epoch to epoch: a new one per epoch waited several times as long for its first batch
            # as a kept one, a large share of a short epoch (docs/performance.md "Data benchmarks"). The order stays
            # litdata's for each epoch (the same batches as with new workers) and a resume still restores the state
            # before the workers start.
            persistent_workers=workers > 0,
            # Every iter() of a DataLoader draws its workers' base seed from this generator, by default the global
            # RNG: a resumed run starts its epoch's iterator mid-epoch, after RNGState restored the streams, so
            # that draw would shift every later dropout mask. The order is litdata's (seed, epoch) and the
            # augmentation draws from its own generator, so the workers need no seed from the run's streams.
            generator=torch.Generator().manual_seed(run_seed()),
        )

    def train_dataloader(self):
        return self._loader("train", train=True)

    def val_dataloader(self):
        return self._loader("val", train=False)

    def test_dataloader(self):
        return self._loader("test", train=False)

    def describe_data(self) -> str:
        return f"'{self.input_dir}'"

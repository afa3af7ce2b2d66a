"""StreamingDataModule: training from litdata chunks (`python -m project prepare`), local or in object storage.

For data that does not fit one machine's memory or disk: litdata's StreamingDataset reads the chunk files of
each split (downloading them into a local cache when `input_dir` is an s3:// URL) and StreamingDataLoader
batches them. The images were resized to the training size and stored as uint8 by prepare, so a sample costs a
read, no decode; batches are converted to float, augmented (training only) and normalised after they reach the
training device (`on_after_batch_transfer`), a whole batch at a time.

What litdata does and what this module relies on or corrects (litdata 0.2.76):
- Sharding: each StreamingDataset detects the process group (rank, world size) and gives each rank and each
  loader worker its own chunks/intervals; Lightning injects no sampler into an IterableDataset.
- Training: shuffled (chunk order, then samples within a chunk window) with seed + epoch: the loader counts
  its epochs itself (each `iter()` is one; Lightning starts one per training epoch) and calls
  `dataset.set_epoch`, so every epoch has a new order. drop_last: every rank and worker gets the same number of
  full batches (DDP ranks stay in lockstep); the remainder is left out that epoch. Loader workers are persistent: they
  read the same batches each epoch as fresh ones (checked over 3 epochs), and a mid-epoch resume under DDP ends
  bit-identical with them (tests/test_streaming_ddp.py: one worker per rank).
- Validation and test: litdata turns drop_last on by itself under DDP (it would leave samples out of the
  metrics); here it is off, and then litdata gives the remainder to the last rank instead of padding, so every
  sample is counted exactly once (ranks may run different numbers of evaluation batches, which is safe: the
  metrics are synced once, at epoch end).
- Resume: StreamingDataLoader has `state_dict()`/`load_state_dict()` (samples yielded, epoch), which Lightning
  saves in every checkpoint for a training loader that has them and restores before the resumed epoch.
"""

import logging
import math
import os
import warnings

import lightning as L
import torch
from torch import Tensor

from project.data.batch_augment import augment_batch
from project.data.normalize import Normalize
from project.data.validate import check_batch_size
from project.data.workers import default_num_workers
from project.errors import ConfigError
from project.prepare import allow_plain_http, join, read_metadata
from project.rng import mix_seed, run_seed

AUGMENT_STREAM = 2  # mix_seed(seed, epoch, batch, rank, 2): a training batch's augmentation


class StreamingDataModule(L.LightningDataModule):
    """Image classification from a dataset written by `python -m project prepare`.

    Args:
        input_dir: what prepare wrote: a local directory or an object-store URL (s3://bucket/prefix).
        batch_size: samples per batch *per device*; the global batch is batch_size x devices x nodes.
        num_workers: loader worker processes per device; None picks one from the CPU count and process count.
        augment: apply the source's training augmentation on each batch (shifts for digits-like data, crop +
            flip for photos; project/data/batch_augment.py), as the image module's in-memory path does.
        shuffle: shuffle the training split (a new order each epoch); False reads it in stored order.
        image_size: the size the data was prepared at (None accepts it); a different size is an error that
            names the prepare command, not a silent mismatch with the model.
        pin_memory: pin host memory for faster copies to the GPU; None means "when CUDA is available".
        cache_dir: where chunks of a remote input_dir are cached (litdata's default when None).
        max_cache_size: cache budget on disk, e.g. "50GB" (None: litdata's default).
        storage_options: passed to litdata (boto3's client arguments for s3://, e.g. endpoint_url); None uses
            the AWS_* environment variables.
    """

    labels_checked = True  # prepare writes class indices in [0, num_classes) only

    def __init__(
        self,
        input_dir: str,
        batch_size: int = 64,
        num_workers: int | None = None,
        augment: bool = True,
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
        self.policy = meta.get("augment_policy", "none") if augment else "none"
        self.split_sizes: dict[str, int] = dict(meta["splits"])
        self._normalize: Normalize | None = None

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def in_channels(self) -> int:
        return self.input_shape[0]

    def prepare_data(self) -> None:
        # Lightning creates the loggers' files between prepare_data and setup: a batch larger than the training
        # split fails here, before a run directory is written (README "Bad input").
        fn = self.trainer.state.fn if self.trainer is not None else None
        self.setup(fn.value if fn is not None else None)

    def setup(self, stage: str | None = None) -> None:
        if stage in (None, "fit"):
            check_batch_size(self.split_sizes["train"], self._world_size(), self.hparams.batch_size)

    def _world_size(self) -> int:
        return self.trainer.world_size if self.trainer is not None else 1

    def _loader(self, split: str, train: bool):
        from litdata import StreamingDataset

        from project.data.stream_loader import BlockLoader, batches_per_block

        hp = self.hparams
        if "://" in self.input_dir:
            allow_plain_http(hp.storage_options)
        workers = hp.num_workers
        if workers is None:
            workers = default_num_workers(True, self.trainer.num_devices if self.trainer is not None else 1)
        pin = hp.pin_memory if hp.pin_memory is not None else torch.cuda.is_available()
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
                # window for one row: 0.47 CPU ms per digits sample instead of 0.024 (AMD EPYC, 2026-12-01).
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
            batch_size=hp.batch_size,
            batches_per_block=k,
            prestart=train and workers > 0,  # the next epoch's first batches read during validation
            num_workers=workers,
            pin_memory=pin,  # Lightning copies pinned batches to the GPU with non_blocking=True
            drop_last=train,
            # Workers kept from epoch to epoch: a new one per epoch waited 0.33-0.38 s for its first batch, 0.09-0.18 s
            # kept (digits, 1 worker, 2 busy cores), a large share of a short epoch. The order stays litdata's for each
            # epoch (the same batches as with new workers) and a resume still restores the state before the
            # workers start.
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

    def on_after_batch_transfer(self, batch, dataloader_idx: int) -> tuple[Tensor, Tensor]:
        """uint8 batch on the device -> augmented (training) and normalised float32 (x, y)."""
        x, y = (batch["image"], batch["label"]) if isinstance(batch, dict) else batch
        trainer = self.trainer
        if self.policy != "none" and trainer is not None and trainer.training:
            # A function of (seed, epoch, batch index in the epoch, rank) only: the same after a resume.
            b = trainer.fit_loop.epoch_loop.batch_progress.current.ready
            g = torch.Generator(device=x.device).manual_seed(
                mix_seed(run_seed(), trainer.current_epoch, b, trainer.global_rank, AUGMENT_STREAM)
            )
            x = augment_batch(x.float().mul_(1 / 255.0), self.policy, g)  # on [0, 1] floats
        if self._normalize is None:
            self._normalize = Normalize(self.mean, self.std)  # the function predict and export use too
        # uint8 (or the augmented [0, 1] floats) -> float32 (x / 255 - mean) / std
        return self._normalize(x), y.long()

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
                f"The checkpoint was trained on classes {state['class_names']}, but '{self.input_dir}' has "
                f"{self.class_names}."
            )

"""StreamingDataModule: the litdata chunks `python -m project prepare` wrote, local or in object storage. litdata
shards, shuffles and resumes inside an epoch; this module adds the checks and fixes below."""

import logging
import os
import warnings

from litdata import StreamingDataLoader, StreamingDataset

from project.data import chunks
from project.data.augment import Recipe, recipe_for
from project.data.base import ImageData
from project.data.loaders import loader_args
from project.data.validate import check_batch_size
from project.rng import run_seed

# Evaluation turns drop_last off under DDP, which litdata warns "may lead to training interruptions": it would in
# training, where every step syncs; evaluation syncs once, at the epoch's end.
logging.getLogger("litdata.streaming.dataset").addFilter(lambda r: "`drop_last`" not in r.getMessage())


class EpochLoader(StreamingDataLoader):
    """litdata's StreamingDataLoader reading the order of the epoch the trainer trains: Lightning restores a
    loader's state only from inside an epoch (from an epoch's end litdata's own epoch count would restart), and
    litdata 0.2.76 clears its `restore` flag only when its generator runs to the end, which Lightning never lets
    it do (the epoch after a mid-epoch resume would replay the restored state)."""

    def __init__(self, dataset: StreamingDataset, epoch, **kwargs) -> None:
        super().__init__(dataset, **kwargs)
        self.epoch, self.resumed = epoch, False

    def load_state_dict(self, obj: dict) -> None:
        super().load_state_dict(obj)
        self.resumed = True

    def __iter__(self):
        # A generator: this runs at the first batch, when trainer.current_epoch is the epoch being trained.
        self.restore, self.resumed = self.restore and self.resumed, False
        if not self.restore and self.epoch is not None:
            self.current_epoch = self.epoch()  # litdata adds 1 (it counts epochs from 1)
        yield from super().__iter__()


class StreamingDataModule(ImageData):
    """Image classification from a dataset written by `python -m project prepare`.

    Args:
        input_dir: what prepare wrote: a local directory or an object-store URL (s3://bucket/prefix).
        batch_size: samples per batch *per device*; the global batch is batch_size x devices x nodes.
        num_workers: loader worker processes per device; None picks one from the CPU and process count.
        augment: the training augmentation (augment.py); unset: the prepared source's.
        shuffle: shuffle the training split (a new order each epoch); False reads it in stored order.
        pin_memory: pin host memory for faster copies to the GPU; None: when CUDA is available.
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
        pin_memory: bool | None = None,
        cache_dir: str | None = None,
        max_cache_size: str | None = None,
        storage_options: dict | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")  # no PyPI request per StreamingDataset
        # litdata gives each worker its own samples (no inaccurate __len__); collate copies the read-only views
        warnings.filterwarnings("ignore", message=r"Your `IterableDataset` has `__len__` defined")
        warnings.filterwarnings("ignore", message=r"The given buffer is not writable")
        self.input_dir = input_dir if chunks.is_remote(input_dir) else os.path.abspath(input_dir)
        self.meta = meta = chunks.read_metadata(self.input_dir, storage_options)
        self.class_names, self.input_shape = list(meta["class_names"]), tuple(meta["input_shape"])
        self.mean, self.std = list(meta["mean"]), list(meta["std"])
        self.split_fingerprint = meta["fingerprint"]  # the image module's, which prepare records
        self.recipe = recipe_for(augment, meta["source"])
        self._checked: set[str] = set()

    def setup(self, stage: str | None = None) -> None:
        if stage in (None, "fit"):
            check_batch_size(self.meta["splits"]["train"], self.world_size(), self.hparams.batch_size)
        stages = {None: chunks.SPLITS, "fit": ("train", "val"), "validate": ("val",), "test": ("test",)}
        # a deleted or damaged file is named here, before the run starts, not by a loader worker
        for split in [s for s in stages.get(stage, ()) if s not in self._checked]:
            chunks.check_split(self.input_dir, split, self.meta, self.hparams.storage_options)
            self._checked.add(split)

    def loader(self, split: str) -> EpochLoader:
        hp, train = self.hparams, split == "train"
        chunks.allow_plain_http(hp.storage_options)  # for an s3:// input_dir; harmless for a local one
        dataset = StreamingDataset(
            chunks.join(self.input_dir, split),
            shuffle=train and hp.shuffle,
            drop_last=train,  # off for evaluation (litdata turns it on under DDP): every sample counted once
            seed=run_seed() % 2**32,  # the same on every rank: the shards are disjoint
            # the requested sample only: litdata's "auto" decoded a window of 32 for each shuffled read
            batch_decode=1,
            storage_options=hp.storage_options,
            max_cache_size=hp.max_cache_size,
            **({"cache_dir": hp.cache_dir} if hp.cache_dir else {}),
        )
        # The loader's own generator (loader_args): worker seeds drawn from the global RNG would shift the streams
        # a resume had just restored (dropout masks).
        args = loader_args(self.trainer, hp.batch_size, hp.num_workers, hp.pin_memory, reads_files=True)
        epoch = (lambda: self.trainer.current_epoch) if train and self.trainer is not None else None
        return EpochLoader(dataset, epoch, drop_last=train, **args)

    def describe_data(self) -> str:
        return f"'{self.input_dir}'"

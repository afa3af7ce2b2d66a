"""The DataLoaders of the map-style paths (the image module's DataLoader path, the any-Dataset module): one
set of arguments, one training loader, one evaluation loader.

Training: ResumableDataLoader (shuffled by (seed, epoch), drop_last, exact mid-epoch resume), sharded per rank
under DDP into equal, disjoint slices of each epoch's order (RankShard, rank_shard.py).
Evaluation: in order; under DDP Lightning's UnrepeatedDistributedSampler gives each sample to exactly one rank
(shards differ by at most one sample), where the default DistributedSampler would pad the last shard with repeated
samples and count them twice in val/test metrics. That is safe in evaluation, where DDP syncs buffers on the first
batch only; Lightning keeps a loader's own DistributedSampler.
"""

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from torch.utils.data import DataLoader, Dataset

from project.data.rank_shard import rank_shard
from project.data.resumable_loader import ResumableDataLoader
from project.data.validate import check_batch_size
from project.data.workers import default_num_workers
from project.rng import run_seed

if TYPE_CHECKING:
    import lightning as L


def world(trainer: "L.Trainer | None") -> tuple[int, int]:
    """(global rank, world size) of this process: (0, 1) without a Trainer."""
    return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)


def loader_args(
    trainer: "L.Trainer | None",
    batch_size: int,
    num_workers: int | None,
    pin_memory: bool | None,
    reads_files: bool,
    collate_fn: Callable | None = None,
) -> dict[str, Any]:
    """The DataLoader arguments every map-style loader of this project shares.

    num_workers None: default_num_workers (0 for tensors already in memory, else from the CPU count and the local
    processes); pin_memory None: when CUDA is available (Lightning copies pinned batches with non_blocking=True).
    """
    if num_workers is None:
        num_workers = default_num_workers(reads_files, trainer.num_devices if trainer is not None else 1)
    return dict(
        batch_size=batch_size,
        num_workers=num_workers,
        pin_memory=pin_memory if pin_memory is not None else torch.cuda.is_available(),
        persistent_workers=num_workers > 0,
        prefetch_factor=2 if num_workers > 0 else None,
        collate_fn=collate_fn,
        # Own generator: creating an iterator then never draws from the global RNG, so validation cannot shift
        # the training streams (an exact resume, and the same run for a seed).
        generator=torch.Generator(),
    )


def train_loader(dataset: Dataset, trainer: "L.Trainer | None", args: dict[str, Any]) -> ResumableDataLoader:
    """Shuffled, drop_last (equal-size steps keep BatchNorm stable and every DDP rank in lockstep) and resumable
    mid-epoch; under DDP this rank's RankShard, which Lightning keeps instead of wrapping the sampler."""
    check_batch_size(len(dataset), world(trainer)[1], args["batch_size"])
    sampler = rank_shard(len(dataset), run_seed(), trainer)
    return ResumableDataLoader(dataset, seed=run_seed(), sampler=sampler, **args)


def eval_loader(dataset: Dataset, trainer: "L.Trainer | None", args: dict[str, Any]) -> DataLoader:
    """In order, every sample once; under DDP each sample on exactly one rank."""
    rank, size = world(trainer)
    sampler = UnrepeatedDistributedSampler(dataset, size, rank, shuffle=False) if size > 1 else None
    return DataLoader(dataset, shuffle=False, sampler=sampler, **args)

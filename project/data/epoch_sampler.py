"""EpochSampler: the sample order of each epoch, fixed by (seed, epoch), sharded by rank, able to start mid-epoch.

The one sampler of both training paths: the in-memory loader slices it per rank itself; on the DataLoader path
(ResumableDataLoader, one process) it is the loader's sampler, and under DDP each rank's loader gets a RankShard
(rank_shard.py), its contiguous slice of this order, which Lightning keeps.

Why not torch's RandomSampler or Lightning's DistributedSampler injection: a RandomSampler without a generator
draws each epoch's order from the global RNG, and Lightning only swaps it for a `DistributedSampler` (ordered by
seed + epoch) under DDP, so a one-process run's order would depend on everything that drew random numbers
before the epoch; and neither can start inside an epoch, which an exact mid-epoch resume needs.
"""

from collections.abc import Callable, Iterator

import torch
from torch import Tensor
from torch.utils.data import Sampler

from project.rng import mix_seed


class EpochSampler(Sampler[int]):
    """Each epoch: a permutation seeded by (seed, epoch), and this rank's slice of it.

    Args:
        n: samples in the split.
        shuffle: a new permutation each epoch; every rank keeps an equal, contiguous, disjoint slice of it (the
            remainder is left out that epoch), so under DDP the ranks see disjoint data and run the same number
            of steps. False (evaluation): in order, rank r keeps every world_size-th sample from r, so every
            sample is seen exactly once.
        seed: the run's seed (project.rng.run_seed); must be equal on all ranks.
        rank, world_size: this process's shard.

    Lightning calls `set_epoch` at each epoch start (it looks for `loader.sampler.set_epoch`, as for a
    DistributedSampler). `skip` leaves out that many of this epoch's first indices in the next iteration only:
    how a resumed DataLoader continues where the checkpoint was taken.
    """

    def __init__(
        self, n: int, shuffle: bool = True, seed: int = 0, rank: int = 0, world_size: int = 1
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}.")
        self.n, self.shuffle, self.seed, self.rank, self.world_size = n, shuffle, seed, rank, world_size
        self.epoch = 0
        self.skip = 0
        self.on_new_epoch: Callable[[], None] | None = None  # set by a loader whose position restarts then

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch and self.on_new_epoch is not None:
            self.on_new_epoch()
        self.epoch = epoch

    def indices(self, epoch: int) -> Tensor:
        """This rank's indices in epoch `epoch`, in order: a function of (n, shuffle, seed, epoch, rank, world)."""
        if self.shuffle:
            g = torch.Generator().manual_seed(mix_seed(self.seed, epoch))
            order = torch.randperm(self.n, generator=g)
            per_rank = self.n // self.world_size
            return order[self.rank * per_rank : (self.rank + 1) * per_rank]
        return torch.arange(self.n)[self.rank :: self.world_size]

    def __iter__(self) -> Iterator[int]:  # the current epoch's indices, like any torch sampler
        skip, self.skip = self.skip, 0
        return iter(self.indices(self.epoch)[skip:].tolist())

    def __len__(self) -> int:  # the whole epoch, also when resuming inside it: Lightning's epoch length stays
        return self.n // self.world_size if self.shuffle else len(range(self.rank, self.n, self.world_size))

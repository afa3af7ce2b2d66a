"""RankShard: one DDP rank's slice of each epoch's order, as a sampler Lightning keeps and a resume can skip into.

Both data modules' DataLoader training paths use it under DDP (project/data/datamodule.py with
`in_memory: false`, project/data/dataset_module.py): Lightning replaces any sampler of a distributed training
loader that is not a `DistributedSampler` with its `DistributedSamplerWrapper`, which pads the shards with
repeated samples and restarts an interrupted epoch from its beginning.
"""

from typing import TYPE_CHECKING

from torch.utils.data import DistributedSampler

from project.data.epoch_sampler import EpochSampler

if TYPE_CHECKING:
    import lightning as L


class RankShard(EpochSampler, DistributedSampler):
    """EpochSampler's slice of one rank, typed as a DistributedSampler: Lightning then keeps it as it is.

    Every rank gets an equal, contiguous, disjoint slice of the epoch's permutation, seeded by (seed, epoch) (the
    remainder is left out that epoch), so the ranks run the same number of steps and see no sample twice; and
    `skip` starts it inside the epoch, which is how ResumableDataLoader continues mid-epoch after a resume.
    DistributedSampler's own __init__ is not run: only its type matters, everything else is EpochSampler's.
    """

    def __init__(self, n: int, seed: int, rank: int, world_size: int) -> None:
        EpochSampler.__init__(self, n, shuffle=True, seed=seed, rank=rank, world_size=world_size)


def rank_shard(n: int, seed: int, trainer: "L.Trainer | None") -> RankShard | None:
    """The training sampler of this trainer's rank under DDP; None in one process (the loader's own EpochSampler)."""
    if trainer is None or trainer.world_size == 1:
        return None
    return RankShard(n, seed, trainer.global_rank, trainer.world_size)

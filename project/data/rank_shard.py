"""RankShard: one DDP rank's slice of each epoch's order, as a sampler Lightning keeps and a resume can skip into.

Both data modules' DataLoader training paths use it under DDP (project/data/datamodule.py with
`in_memory: false`, project/data/dataset_module.py): Lightning replaces any sampler of a distributed training
loader that is not a `DistributedSampler` with its `DistributedSamplerWrapper`, which pads the shards with
repeated samples and restarts an interrupted epoch from its beginning.
"""

from torch.utils.data import DistributedSampler

from project.data.epoch_sampler import EpochSampler


class RankShard(EpochSampler, DistributedSampler):
    """EpochSampler's slice of one rank, typed as a DistributedSampler: Lightning then keeps it as it is.

    Every rank gets an equal, contiguous, disjoint slice of the epoch's permutation, seeded by (seed, epoch) (the
    remainder is left out that epoch), so the ranks run the same number of steps and see no sample twice; and
    `skip` starts it inside the epoch, which is how ResumableDataLoader continues mid-epoch after a resume.
    DistributedSampler's own __init__ is not run: only its type matters, everything else is EpochSampler's.
    """

    def __init__(self, n: int, seed: int, rank: int, world_size: int) -> None:
        EpochSampler.__init__(self, n, shuffle=True, seed=seed, rank=rank, world_size=world_size)

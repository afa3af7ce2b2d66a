"""A training DataLoader that can stop anywhere in an epoch and continue at the same sample.

Lightning saves the train loader's position in every checkpoint when the *loader object* has
`state_dict()` / `load_state_dict()` (FitLoop.on_save_checkpoint -> CombinedLoader._state_dicts), and restores
it in FitLoop.setup_data before the first batch of the resumed run. A plain DataLoader has neither, so this
subclass provides them (the in-memory loader has the same two methods).

Why not a stock loader: torchdata's StatefulDataLoader has the same two methods, but it is another package (not
among this template's dependencies) for what is one integer here, since the order is EpochSampler's, the sampler
the in-memory loader uses too. Lightning's DistributedSampler injection orders by seed + epoch, but only under DDP
and only from the start of an epoch; under DDP the data modules pass a RankShard instead (rank_shard.py), an
EpochSampler slice per rank that Lightning keeps as it is.

How the position is exact:
- The order of epoch `e` is EpochSampler's permutation seeded by (seed, e): a function of (seed, epoch)
  only, never of the global RNG, so a resumed process recomputes the same order.
- `state_dict()` records the epoch and the number of batches this loader has *handed out* in it. Lightning
  does not prefetch from loaders with a length, so at a checkpoint (on_train_batch_end) that is exactly the
  number of batches trained on. A resumed iterator skips that many batches' indices without loading them.
- Under DDP every rank's sampler is a RankShard: its slice of the same (seed, epoch) permutation, and the ranks
  run in lockstep, so rank 0's position (the one saved) is every rank's, and each rank skips as many batches
  into its own slice. A resume with another world size or batch size would slice or batch the epoch
  differently: `load_state_dict` refuses it, as the in-memory loader does.
- Worker processes (num_workers > 0) draw their base seed from `self.generator`, re-seeded per epoch, so a
  dataset's own randomness in a worker is the same after an epoch-boundary resume; the image modules' workers
  draw none (they decode and resize; augmentation runs per batch on the device, seeded by the batch's place).
- A sampler that is not an EpochSampler (Lightning re-creating the loader with its DistributedSamplerWrapper
  when the loader is given a plain sampler under DDP, or `overfit_batches`) cannot start mid-epoch: after a
  mid-epoch resume there, the rest of the interrupted epoch is drawn from the start of that epoch's order.
"""

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from project.data.epoch_sampler import EpochSampler
from project.rng import mix_seed

WORKER_SEED_STREAM = 1  # mix_seed(seed, epoch, 1): worker base seeds; mix_seed(seed, epoch) is the order


class ResumableDataLoader(DataLoader):
    """Shuffled training loader (drop_last) whose position is saved in and restored from checkpoints.

    Args:
        dataset: a map-style dataset.
        batch_size: samples per batch.
        seed: data-order seed (the run's seed); the order of epoch e depends on (seed, e) only.
        sampler: None = the whole epoch's EpochSampler (one process); a RankShard under DDP (this rank's slice,
            skips like an EpochSampler); any other sampler (Lightning re-creating the loader, e.g. with its
            DistributedSamplerWrapper) is kept, and then mid-epoch skipping is disabled.
        **kwargs: the remaining DataLoader arguments (num_workers, pin_memory, ...). `shuffle` and `drop_last`
            are fixed here.
    """

    def __init__(
        self, dataset: Dataset, batch_size: int, seed: int = 0, sampler: Sampler | None = None, **kwargs: Any
    ) -> None:
        kwargs.pop("shuffle", None)
        kwargs.pop("drop_last", None)
        kwargs.setdefault("generator", torch.Generator())  # worker base seeds: never from the global RNG
        sampler = sampler if sampler is not None else EpochSampler(len(dataset), shuffle=True, seed=seed)
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, drop_last=True, **kwargs)
        self.seed = seed
        self._batches = 0  # batches handed out in the current epoch
        self._resume: dict | None = None  # position loaded from a checkpoint, applied on the next iteration

    @property
    def epoch(self) -> int:
        return getattr(self.sampler, "epoch", 0)

    def __iter__(self) -> Iterator[Any]:
        # A generator: its body runs at the first next(), after Lightning has called set_epoch.
        skip = 0
        if (
            self._resume is not None
            and self._resume["epoch"] == self.epoch
            and self._resume["batches"] < len(self)
        ):
            skip = self._resume["batches"]
        self._resume = None
        if skip and isinstance(self.sampler, EpochSampler):
            self.sampler.skip = skip * self.batch_size
        elif skip:
            skip = 0  # a foreign sampler cannot skip; the epoch restarts from its beginning
        if self.generator is not None:
            self.generator.manual_seed(mix_seed(self.seed, self.epoch, WORKER_SEED_STREAM))
        self._batches = skip
        for batch in super().__iter__():
            self._batches += 1
            yield batch

    def _world_size(self) -> int:
        sampler = self.sampler  # a RankShard or EpochSampler; a DistributedSampler(Wrapper) has num_replicas
        return getattr(sampler, "world_size", getattr(sampler, "num_replicas", 1))

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "batches": self._batches,
            "seed": self.seed,
            "world_size": self._world_size(),
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        # Checkpoints written before these two keys existed carry neither: nothing to compare then.
        saved = (state.get("world_size", self._world_size()), state.get("batch_size", self.batch_size))
        if saved != (self._world_size(), self.batch_size):
            raise ValueError(
                f"This checkpoint's loader ran with world_size={saved[0]} and batch_size={saved[1]}, now "
                f"{self._world_size()} and {self.batch_size}: the rest of its epoch cannot be reproduced. Resume "
                "with the same devices and --data.init_args.batch_size."
            )
        self._resume = dict(state)

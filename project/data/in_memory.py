"""The fast path for data that fits in memory: the whole split as one tensor, batches drawn by index.

Why not only a DataLoader over a Dataset: it collates per-sample tensors through Python for each batch, while
here a batch is one `index_select` on the training device (the loader alone: 14-18x the DataLoader's samples/s on
the digits). Both serve the same batches for the same seed; the data module then
augments and normalises them per batch on either path. airbench does the same for CIFAR-10.

What a loader that is not a torch DataLoader does itself: Lightning injects its DistributedSampler only into
DataLoaders, so this loader shards by rank (EpochSampler); and Lightning saves a loader's position only through
the loader's own `state_dict`/`load_state_dict`, so it keeps its position for an exact mid-epoch resume.
"""

from collections.abc import Iterator

import torch
from torch import Tensor

from project.data.epoch_sampler import EpochSampler


class InMemoryLoader:
    """Yields (pixels, labels) batches from images held in one tensor (on the training device).

    The batches are what the DataLoader path's would be for the same sampler (the same EpochSampler order, the
    same pixels); the data module augments and normalises them (project/data/base.py), as on every path.

    Args:
        images: (N, C, H, W) uint8, or float in [0, 1]; kept as given (uint8 stays 4x smaller).
        labels: (N,) integer class indices.
        batch_size: samples per batch on this rank.
        shuffle: new permutation each epoch, drop the last partial batch (training); else in order, keep it.
        seed: permutation seed; must be equal on all ranks.
        rank, world_size: this process's shard.
        device: where the split lives and batches are built.

    State for exact resume (Lightning saves it in checkpoints as loops.fit_loop.state_dict.combined_loader):
    `state_dict()` = {epoch, position (batches already handed out this epoch), seed, ...}; after
    `load_state_dict`, the next iteration yields exactly the remaining batches of that epoch, because the order
    comes from (seed, epoch) only.
    """

    def __init__(
        self,
        images: Tensor,
        labels: Tensor,
        batch_size: int,
        shuffle: bool,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | str = "cpu",
    ) -> None:
        self.device = torch.device(device)
        self.images = images.to(self.device)
        self.labels = labels.long().to(self.device)
        self.batch_size, self.shuffle = batch_size, shuffle
        self.sampler = EpochSampler(len(labels), shuffle, seed, rank, world_size)
        self.sampler.on_new_epoch = self._restart
        self.batch_sampler = None  # Lightning's dataloader checks read this attribute next to `sampler`
        self.position = 0  # batches of the current epoch already handed out

    def __len__(self) -> int:
        if self.shuffle:  # equal shards, full batches only: every rank runs the same number of steps
            return len(self.sampler) // self.batch_size
        return -(-len(self.sampler) // self.batch_size)

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def _restart(self) -> None:
        self.position = 0

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        if not self.shuffle:
            # Evaluation always starts at the split's first batch: a sanity check or limit_val_batches stops
            # an iteration early, and continuing from there would validate on other samples next time.
            self.position = 0
        if self.position >= len(self):  # the previous epoch ran to its end: start the next one
            self.sampler.epoch += 1
            self.position = 0
        order = self.sampler.indices(self.sampler.epoch).to(self.device)
        for b in range(self.position, len(self)):
            idx = order[b * self.batch_size : (b + 1) * self.batch_size]
            # counted when handed out: a checkpoint taken during this step resumes after it
            self.position = b + 1
            # index_select, not images[idx]: advanced indexing runs an OpenMP parallel region that waits for a
            # busy core, index_select a plain gather
            yield self.images.index_select(0, idx), self.labels.index_select(0, idx)

    def state_dict(self) -> dict:
        s = self.sampler
        return {
            "epoch": s.epoch,
            "position": self.position,
            "seed": s.seed,
            "world_size": s.world_size,
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state: dict) -> None:
        if (
            state.get("world_size", 1) != self.sampler.world_size
            or state.get("batch_size") != self.batch_size
        ):
            raise ValueError(
                f"This checkpoint's loader ran with world_size={state.get('world_size')} and batch_size="
                f"{state.get('batch_size')}, now {self.sampler.world_size} and {self.batch_size}: the rest of its "
                "epoch cannot be reproduced. Resume with the same devices and --data.init_args.batch_size."
            )
        self.sampler.epoch, self.position, self.sampler.seed = (
            state["epoch"],
            state["position"],
            state["seed"],
        )

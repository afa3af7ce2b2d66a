"""The fast path for data that fits in memory: the whole split as one tensor, batches drawn by index.

Why not a DataLoader over a Dataset: the DataLoader path collates per-sample tensors and runs a per-sample
transform in Python for each image. On digits (2 busy CPU cores, 2026-11-30) that path delivered 0.5-1.7k
samples/s, less than the ConvNet trains on (~1.3k/s), while gathering and augmenting whole batches here gave
35-190k samples/s, 40-110x (`make bench`: loader.*); with it, training ran 1.8x faster end to end
(options.dataloader_path: x0.55). airbench does the same for CIFAR-10.

What a loader that is not a torch DataLoader does itself: Lightning injects its DistributedSampler only into
DataLoaders, so this loader shards by rank (EpochSampler); and Lightning saves a loader's position only through
the loader's own `state_dict`/`load_state_dict`, so it keeps its position for an exact mid-epoch resume.
"""

from collections.abc import Iterator

import torch
from torch import Tensor

from project.data.batch_augment import AUGMENT_POLICIES, augment_batch
from project.data.epoch_sampler import EpochSampler
from project.data.normalize import normalize
from project.rng import mix_seed


class InMemoryLoader:
    """Yields normalised (x, y) batches from images held in one tensor (on the training device).

    Args:
        images: (N, C, H, W) uint8, or float in [0, 1]; kept as given (uint8 stays 4x smaller).
        labels: (N,) integer class indices.
        batch_size: samples per batch on this rank.
        mean, std: per-channel normalisation, applied after augmentation (zero fill = black, as before).
        shuffle: new permutation each epoch, drop the last partial batch (training); else in order, keep it.
        augment: "digits", "natural" or "none" (project/data/batch_augment.py).
        seed: permutation and augmentation seed; must be equal on all ranks.
        rank, world_size: this process's shard.
        device: where the split lives and batches are built.

    State for exact resume (Lightning saves it in checkpoints as loops.fit_loop.state_dict.combined_loader):
    `state_dict()` = {epoch, position (batches already handed out this epoch), seed, ...}; after
    `load_state_dict`, the next iteration yields exactly the remaining batches of that epoch, with the same
    augmentation, because every batch's randomness comes from (seed, epoch, batch index) only.
    """

    def __init__(
        self,
        images: Tensor,
        labels: Tensor,
        batch_size: int,
        mean: list[float],
        std: list[float],
        shuffle: bool,
        augment: str = "none",
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | str = "cpu",
    ) -> None:
        if augment not in AUGMENT_POLICIES:
            raise ValueError(f"augment='{augment}': expected one of {AUGMENT_POLICIES}.")
        self.device = torch.device(device)
        self.images = images.to(self.device)
        self.labels = labels.long().to(self.device)
        self.scale = 1 / 255.0 if images.dtype == torch.uint8 else 1.0
        self.mean = torch.tensor(mean, dtype=torch.float32, device=self.device).view(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32, device=self.device).view(-1, 1, 1)
        self.batch_size, self.shuffle, self.augment = batch_size, shuffle, augment
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
        epoch = self.sampler.epoch
        order = self.sampler.indices(epoch).to(self.device)
        for b in range(self.position, len(self)):
            idx = order[b * self.batch_size : (b + 1) * self.batch_size]
            # counted when handed out: a checkpoint taken during this step resumes after it
            self.position = b + 1
            yield self._batch(idx, epoch, b)

    def _batch(self, idx: Tensor, epoch: int, b: int) -> tuple[Tensor, Tensor]:
        # index_select, not images[idx]: advanced indexing took ~8 ms per 64x1x8x8 batch on 2 busy cores
        # (an OpenMP parallel region waiting for a core), index_select ~7 us.
        x = self.images.index_select(0, idx).float()
        if self.scale != 1.0:
            x.mul_(self.scale)
        if self.augment != "none":
            g = torch.Generator(device=self.device).manual_seed(
                mix_seed(self.sampler.seed, epoch, b, self.sampler.rank)
            )
            x = augment_batch(x, self.augment, g)
        return normalize(x, self.mean, self.std), self.labels.index_select(0, idx)

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

"""The fast path for data that fits in memory: the whole split as one tensor, batches drawn by index.

Why not a DataLoader over a Dataset: the DataLoader path collates per-sample tensors and runs a per-sample
transform in Python for each image. On digits (2 busy CPU cores, 2026-11-30) that path delivered 0.5-1.7k
samples/s, less than the ConvNet trains on (~1.3k/s), while gathering and augmenting whole batches here gave
35-190k samples/s, 40-110x (`make bench`: loader.*); with it, training ran 1.8x faster end to end
(options.dataloader_path: x0.55). airbench does the same for CIFAR-10.
"""

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

AUGMENT_POLICIES = ("digits", "natural", "none")


def _mix(*parts: int) -> int:
    """A 63-bit seed from integers: one independent stream per (seed, epoch, batch), no global RNG touched."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = ((h ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & 0x7FFFFFFFFFFFFFFF


class EpochSampler:
    """The sample order of each epoch: a permutation seeded by (seed, epoch), and this rank's slice of it.

    Every rank draws the same permutation (same seed) and keeps a disjoint contiguous slice of equal length,
    so under DDP the ranks see disjoint data and run the same number of steps. Lightning calls `set_epoch`
    at each epoch start (it looks for `loader.sampler.set_epoch`, as for a DistributedSampler).
    """

    def __init__(self, n: int, shuffle: bool, seed: int, rank: int = 0, world_size: int = 1) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}.")
        self.n, self.shuffle, self.seed, self.rank, self.world_size = n, shuffle, seed, rank, world_size
        self.epoch = 0
        self.on_new_epoch = None  # set by the loader: a new epoch restarts its position

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch and self.on_new_epoch is not None:
            self.on_new_epoch()
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:  # the current epoch's indices, like any torch sampler
        return iter(self.indices(self.epoch).tolist())

    def __len__(self) -> int:
        return len(self.indices(self.epoch))

    def indices(self, epoch: int) -> Tensor:
        if self.shuffle:
            g = torch.Generator().manual_seed(_mix(self.seed, epoch))
            order = torch.randperm(self.n, generator=g)
            per_rank = self.n // self.world_size  # equal shards: the remainder is left out this epoch
            return order[self.rank * per_rank : (self.rank + 1) * per_rank]
        return torch.arange(self.n)[self.rank :: self.world_size]  # evaluation: every sample exactly once


def augment_batch(x: Tensor, policy: str, generator: torch.Generator) -> Tensor:
    """Augment a whole (B, C, H, W) float batch in [0, 1] in one or two tensor ops.

    digits: a random affine per sample (rotation +-10 deg, scale 0.9-1.1, shift +-10%), zero fill, no flips
    (a flipped 2 is not a 2), the same distribution as the per-sample v2.RandomAffine of the DataLoader path.
    natural: random crop from a reflect-padded image (pad = size/8) and a horizontal flip for half the batch.
    """
    if policy == "none":
        return x
    b, c, h, w = x.shape
    dev = x.device

    def uniform(lo: float, hi: float) -> Tensor:
        return torch.rand(b, generator=generator, device=dev) * (hi - lo) + lo

    if policy == "digits":
        angle, scale = uniform(-10.0, 10.0).deg2rad(), uniform(0.9, 1.1)
        tx, ty = uniform(-0.2, 0.2), uniform(-0.2, 0.2)  # normalised coords span 2: 0.2 = 10% of the size
        cos, sin = (angle.cos() / scale)[:, None, None], (angle.sin() / scale)[:, None, None]  # (B, 1, 1)
        # The sampling grid by broadcasting, not F.affine_grid: its batched matmul took 180 us of a 64x8x8
        # batch on 2 busy cores, this takes ~20 us. Pixel centres in [-1, 1] (align_corners=False).
        ys = (torch.arange(h, device=dev, dtype=x.dtype) * 2 + 1) / h - 1
        xs = (torch.arange(w, device=dev, dtype=x.dtype) * 2 + 1) / w - 1
        gx = cos * xs[None, None, :] - sin * ys[None, :, None] + tx[:, None, None]  # (B, H, W)
        gy = sin * xs[None, None, :] + cos * ys[None, :, None] + ty[:, None, None]
        grid = torch.stack([gx, gy], dim=-1).to(x.dtype)  # (B, H, W, 2)
        return F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    if policy == "natural":
        pad = max(1, min(h, w) // 8)
        padded = F.pad(x, (pad, pad, pad, pad), mode="reflect")
        dy = torch.randint(0, 2 * pad + 1, (b,), generator=generator, device=dev)
        dx = torch.randint(0, 2 * pad + 1, (b,), generator=generator, device=dev)
        flip = torch.rand(b, generator=generator, device=dev) < 0.5
        ar_h, ar_w = torch.arange(h, device=dev), torch.arange(w, device=dev)
        rows = dy[:, None] + ar_h  # (B, H)
        cols = dx[:, None] + torch.where(flip[:, None], w - 1 - ar_w, ar_w)  # (B, W), reversed = flipped
        bi = torch.arange(b, device=dev)[:, None, None]
        out = padded.permute(0, 2, 3, 1)[bi, rows[:, :, None], cols[:, None, :]]  # (B, H, W, C)
        return out.permute(0, 3, 1, 2).contiguous(
            memory_format=torch.channels_last if c > 1 else torch.contiguous_format
        )
    raise ValueError(f"Unknown augmentation policy '{policy}'; expected one of {AUGMENT_POLICIES}.")


class InMemoryLoader:
    """Yields normalised (x, y) batches from images held in one tensor (on the training device).

    Args:
        images: (N, C, H, W) uint8, or float in [0, 1]; kept as given (uint8 stays 4x smaller).
        labels: (N,) integer class indices.
        batch_size: samples per batch on this rank.
        mean, std: per-channel normalisation, applied after augmentation (zero fill = black, as before).
        shuffle: new permutation each epoch, drop the last partial batch (training); else in order, keep it.
        augment: "digits", "natural" or "none" (see `augment_batch`).
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
        self.mean = torch.tensor(mean, dtype=torch.float32, device=self.device).view(1, -1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32, device=self.device).view(1, -1, 1, 1)
        self.batch_size, self.shuffle, self.augment = batch_size, shuffle, augment
        self.sampler = EpochSampler(len(labels), shuffle, seed, rank, world_size)
        self.sampler.on_new_epoch = self._restart
        self.batch_sampler = None  # Lightning's dataloader checks read this attribute next to `sampler`
        self.position = 0  # batches of the current epoch already handed out

    def __len__(self) -> int:
        s = self.sampler
        if self.shuffle:  # equal shards, full batches only: every rank runs the same number of steps
            return (s.n // s.world_size) // self.batch_size
        return -(-len(range(s.rank, s.n, s.world_size)) // self.batch_size)

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
            self.position = (
                b + 1
            )  # counted when handed out: a checkpoint taken during this step resumes after it
            yield self._batch(idx, epoch, b)

    def _batch(self, idx: Tensor, epoch: int, b: int) -> tuple[Tensor, Tensor]:
        # index_select, not images[idx]: advanced indexing took ~8 ms per 64x1x8x8 batch on 2 busy cores
        # (an OpenMP parallel region waiting for a core), index_select ~7 us.
        x = self.images.index_select(0, idx).float()
        if self.scale != 1.0:
            x.mul_(self.scale)
        if self.augment != "none":
            g = torch.Generator(device=self.device).manual_seed(
                _mix(self.sampler.seed, epoch, b, self.sampler.rank)
            )
            x = augment_batch(x, self.augment, g)
        return (x - self.mean) / self.std, self.labels.index_select(0, idx)

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

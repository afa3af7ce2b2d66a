"""Normalisation statistics: one rule for every path (tensors in memory, image files, prepared chunks).

The per-channel mean and std come from the training split only (never val or test, carved or not), measured on the
pixels at the training size exactly as training receives them (project/data/normalize.py's `resize`), on the
[0, 1] scale, from at most STATS_LIMIT training samples evenly spaced in the split's order. The image module and
`prepare` call the same function on the same samples, so a folder trained from files, from memory or from the
chunks prepare wrote is normalised with the same numbers.
"""

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

# Enough samples for the statistics to settle (their standard error is far below what changes training), few
# enough that a large ImageFolder is decoded for them once, in seconds (the folder index keeps the result).
STATS_LIMIT = 4096


def stats_indices(n: int, limit: int = STATS_LIMIT) -> range:
    """Positions 0, step, 2*step, ... in a split of n samples: at most `limit` of them, evenly spaced."""
    return range(0, n, max(1, math.ceil(n / limit)))


def train_stats(pixels: Callable[[int], Tensor], train: Sequence[int]) -> tuple[list[float], list[float]]:
    """Per-channel (mean, std) of the training samples `train` (indices passed to `pixels`, in split order).

    pixels(i): sample i as a (C, H, W) tensor at the training size, uint8 (0-255) or float in [0, 1].
    Sums are accumulated in float64 one sample at a time, so memory stays one image whatever the limit; std is
    the unbiased one (torch.std's), clamped away from 0 so a constant channel cannot divide by zero.
    """
    total = total_sq = None
    count = 0
    for pos in stats_indices(len(train)):
        x = pixels(train[pos])
        x = x.to(torch.float64) / 255.0 if x.dtype == torch.uint8 else x.to(torch.float64)
        flat = x.flatten(1)
        s, sq = flat.sum(1), (flat * flat).sum(1)
        total, total_sq = (s, sq) if total is None else (total + s, total_sq + sq)
        count += flat.shape[1]
    if total is None:
        raise ValueError("no training samples to compute normalisation statistics from")
    mean = total / count
    var = (total_sq - count * mean * mean) / max(1, count - 1)
    std = var.clamp_min(0).sqrt().clamp_min(1e-6)
    return mean.tolist(), std.tolist()


def tensor_stats(images: Tensor) -> tuple[list[float], list[float]]:
    """`train_stats` of a split held as one (N, C, H, W) tensor."""
    return train_stats(images.__getitem__, range(len(images)))

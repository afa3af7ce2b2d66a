"""Normalisation statistics, one rule for every path and `prepare`: the training split only, of the pixels at
the training size, from at most STATS_LIMIT samples evenly spaced in the split's order."""

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

# Enough samples for the statistics to settle, few enough that a large ImageFolder is decoded for them in
# seconds (once: the folder index keeps the result).
STATS_LIMIT = 4096


def train_stats(pixels: Callable[[int], Tensor], train: Sequence[int]) -> tuple[list[float], list[float]]:
    """Per-channel (mean, std) on the [0, 1] scale of pixels(i) for i in `train`, summed in float64 one sample at a
    time; the std clamped away from 0 so that a constant channel cannot divide by zero."""
    total = total_sq = count = 0
    for pos in range(0, len(train), max(1, math.ceil(len(train) / STATS_LIMIT))):
        x = pixels(train[pos])
        flat = (x.to(torch.float64) / 255.0 if x.dtype == torch.uint8 else x.to(torch.float64)).flatten(1)
        total, total_sq, count = total + flat.sum(1), total_sq + (flat * flat).sum(1), count + flat.shape[1]
    if count == 0:
        raise ValueError("no training samples to compute normalisation statistics from")
    mean = total / count
    var = (total_sq - count * mean * mean) / max(1, count - 1)
    return mean.tolist(), var.clamp_min(0).sqrt().clamp_min(1e-6).tolist()


def tensor_stats(images: Tensor) -> tuple[list[float], list[float]]:
    """`train_stats` of a split held as one (N, C, H, W) tensor."""
    return train_stats(images.__getitem__, range(len(images)))

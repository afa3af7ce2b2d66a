"""The preprocessing of every path, evaluation, predict and export, so they cannot drift apart: `resize` once per
image in the pixels' own type, then `normalize` on the device with the training split's statistics
(`train_stats`). Torch only: predict imports this without torchvision.
"""

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torch.nn import functional as F

STATS_LIMIT = 4096  # statistics from at most this many evenly spaced training images: settled, and quick
# All that predict and export read of the data module, from its state_dict() in the checkpoint (docs/data.md).
CONTRACT = ("class_names", "input_shape", "mean", "std")


def contract_gaps(data) -> list[str]:
    """The CONTRACT keys that a data module's state_dict() (or that state) lacks or leaves None."""
    state = data.state_dict() if hasattr(data, "state_dict") else data
    return [k for k in CONTRACT if not isinstance(state, dict) or state.get(k) is None]


def resize(x: Tensor, size: tuple[int, int] | list[int] | None) -> Tensor:
    """A (C, H, W) or (N, C, H, W) image at `size` (H, W): bilinear, antialiased (torch's uint8 kernel, the one
    torchvision's `resize` runs), in x's dtype (uint8 or float in [0, 1], clamped); x itself at that size."""
    if size is None or tuple(x.shape[-2:]) == tuple(size):
        return x
    # contiguous: the uint8 kernel rounds differently for a channels-last input, and every path must agree
    batch = (x if x.ndim == 4 else x[None]).contiguous()
    if batch.dtype != torch.uint8:
        batch = batch.to(torch.float32)
    out = F.interpolate(batch, size=list(size), mode="bilinear", align_corners=False, antialias=True)
    if out.dtype != torch.uint8:
        out = out.clamp_(0, 1)
    return (out if x.ndim == 4 else out[0]).contiguous()


def normalize(x: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """uint8 pixels (0-255) or float in [0, 1] -> float32 (x / 255 - mean) / std; mean, std: (C, 1, 1)."""
    if x.dtype == torch.uint8:  # as torchvision's ToDtype(float32, scale=True), then its Normalize
        return x.to(torch.float32).mul_(1.0 / 255).sub_(mean).div_(std)
    return x.to(torch.float32).sub(mean).div_(std)  # never writes into the caller's tensor


def train_stats(pixels: Callable[[int], Tensor], train: Sequence[int]) -> tuple[list[float], list[float]]:
    """Per-channel (mean, std) on the [0, 1] scale of pixels(i) for i in `train`, summed in float64; the std
    clamped away from 0 so that a constant channel cannot divide by zero."""
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
    return train_stats(images.__getitem__, range(len(images)))

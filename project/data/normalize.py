"""The preprocessing of every path, evaluation, predict and export, so they cannot drift apart: `resize` once
per image, in the pixels' own type (uint8 travels as a quarter of float32), then `normalize` on the device.
Torch only: predict imports this without torchvision.
"""

import torch
from torch import Tensor, nn
from torch.nn import functional as F


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


class Normalize(nn.Module):
    """`normalize` with the per-channel statistics as buffers (they follow `.to(device)`)."""

    def __init__(self, mean: list[float], std: list[float]) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(-1, 1, 1), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        if self.mean.device != x.device:
            self.to(x.device)
        return normalize(x, self.mean, self.std)

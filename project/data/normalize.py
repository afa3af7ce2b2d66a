"""Normalisation of image batches: the one definition that training, predict and export share.

Pixels travel as they were decoded (uint8, 4x smaller than float32) through the loader and the copy to the
device; the data module's `on_after_batch_transfer` then normalises the whole batch at once on the device with
`Normalize`, and `project/inference.py` (predict, export's preprocessing) calls the same `normalize` function,
so the three cannot drift apart.
"""

import torch
from torch import Tensor, nn


def normalize(x: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """uint8 pixels (0-255) or float in [0, 1] -> float32 (x / 255 - mean) / std, per channel.

    x: (C, H, W) or (B, C, H, W); mean and std: float32 tensors of shape (C, 1, 1) on x's device.
    """
    if x.dtype == torch.uint8:  # as torchvision's ToDtype(float32, scale=True), then its Normalize's sub, div
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

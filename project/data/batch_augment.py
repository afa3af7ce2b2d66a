"""Augmentation of a whole batch at once, on the device the batch is on: the in-memory loader's transforms.

The DataLoader path augments one sample at a time with torchvision's v2 transforms (project/data/transforms.py);
here one or two tensor ops transform a (B, C, H, W) batch, each sample with its own random parameters drawn from
a generator the caller seeds, so a batch's augmentation is a function of that seed alone.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

AUGMENT_POLICIES = ("digits", "natural", "none")


def augment_batch(x: Tensor, policy: str, generator: torch.Generator) -> Tensor:
    """Augment a whole (B, C, H, W) float batch in [0, 1] in one or two tensor ops.

    digits: a random affine per sample (rotation +-10 deg, scale 0.9-1.1, shift +-10% of the size), zero fill,
    no flips (a flipped 2 is not a 2). The ranges of the DataLoader path's `v2.RandomAffine(degrees=10,
    translate=(0.1, 0.1), scale=(0.9, 1.1))`, not its exact distribution: RandomAffine rounds each shift to whole
    pixels (on 8x8 digits: 0 or +-1 pixel) and samples the nearest pixel, while here shifts are continuous
    (+-10% of the size before the scale: about 0.8 pixel on 8x8), applied before the rotation and scale, and
    sampled bilinearly.
    natural: random crop from a reflect-padded image (pad = size/8) and a horizontal flip for half the batch,
    as the DataLoader path's RandomCrop(padding=size/8, reflect) + RandomHorizontalFlip.
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

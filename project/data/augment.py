"""Training augmentation, one implementation per recipe, on whole batches on the training device for every
path. A batch's draws come from (run seed, epoch, batch index, rank) only: the same batch gets the same
augmentation on every path and after a resume."""

from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor

from project.rng import mix_seed

Recipe = Literal["none", "affine", "crop_flip", "resized_crop"]
RECIPES: tuple[str, ...] = get_args(Recipe)
# Unset `augment`: small affine moves for digit-like data (never flips: a flipped 2 is not a 2), pad-and-crop +
# flip for small photos (CIFAR-10's usual recipe), random resized crops + flip for photo folders (ImageNet's),
# nothing for FashionMNIST (its garments are centred and aligned).
SOURCE_RECIPE = {
    "digits": "affine",
    "mnist": "affine",
    "fashionmnist": "none",
    "cifar10": "crop_flip",
    "imagefolder": "resized_crop",
}
CROP_SCALE = (0.08, 1.0)  # resized_crop's area range and aspect range: torchvision's ImageNet recipe
CROP_RATIO = (3 / 4, 4 / 3)
AUGMENT_STREAM = 2  # mix_seed(seed, epoch, batch, rank, 2): a training batch's augmentation


def recipe_for(augment: str | None, source: str) -> str:
    return SOURCE_RECIPE.get(source, "none") if augment is None else augment


def augment_training_batch(x: Tensor, recipe: str, seed: int, epoch: int, batch: int, rank: int) -> Tensor:
    """Pixels (uint8, or float in [0, 1]) -> augmented float32 in [0, 1] (x itself for recipe "none")."""
    if recipe == "none":
        return x
    g = torch.Generator(device=x.device).manual_seed(mix_seed(seed, epoch, batch, rank, AUGMENT_STREAM))
    x = x.to(torch.float32).mul_(1 / 255.0) if x.dtype == torch.uint8 else x.to(torch.float32)
    return augment_batch(x, recipe, g)


def augment_batch(x: Tensor, recipe: str, generator: torch.Generator) -> Tensor:
    """Augment a whole (B, C, H, W) float batch in [0, 1], each sample with its own draws.

    affine: rotation +-10 deg, scale 0.9-1.1, shift +-10% of the size, sampled bilinearly, zero fill, no flips.
    crop_flip: a crop of a reflect-padded image (pad = size/8) and a horizontal flip for half the batch
    (torchvision's RandomCrop(padding=size/8, reflect) + RandomHorizontalFlip).
    resized_crop: a crop of CROP_SCALE of the area, aspect ratio in CROP_RATIO (log-uniform), scaled back
    bilinearly, and a horizontal flip for half the batch: torchvision's RandomResizedCrop + RandomHorizontalFlip,
    cropped from the image at the training size (the only size every path has: prepared chunks store that), a
    crop that does not fit clipped to the image's side instead of drawn again.
    """
    if recipe == "none":
        return x
    b, c, h, w = x.shape
    dev = x.device

    def uniform(lo: float, hi: float) -> Tensor:
        return torch.rand(b, generator=generator, device=dev) * (hi - lo) + lo

    # pixel centres in grid_sample's coordinates, [-1, 1] (align_corners=False)
    ys = (torch.arange(h, device=dev, dtype=x.dtype) * 2 + 1) / h - 1
    xs = (torch.arange(w, device=dev, dtype=x.dtype) * 2 + 1) / w - 1
    if recipe == "affine":
        angle, scale = uniform(-10.0, 10.0).deg2rad(), uniform(0.9, 1.1)
        tx, ty = uniform(-0.2, 0.2), uniform(-0.2, 0.2)  # normalised coords span 2: 0.2 = 10% of the size
        cos, sin = (angle.cos() / scale)[:, None, None], (angle.sin() / scale)[:, None, None]
        # The grid by broadcasting, not F.affine_grid: its batched matmul costs more on small batches.
        gx = cos * xs[None, None, :] - sin * ys[None, :, None] + tx[:, None, None]  # (B, H, W)
        gy = sin * xs[None, None, :] + cos * ys[None, :, None] + ty[:, None, None]
        grid = torch.stack([gx, gy], dim=-1).to(x.dtype)
        return F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    if recipe == "crop_flip":
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
    if recipe == "resized_crop":
        area = uniform(*CROP_SCALE)
        ratio = uniform(*torch.tensor(CROP_RATIO).log().tolist()).exp()  # width / height, in pixels
        cw = (area * ratio * h / w).sqrt().clamp(max=1.0)  # crop width and height, fractions of the image's
        ch = (area / ratio * w / h).sqrt().clamp(max=1.0)
        cx, cy = uniform(-1.0, 1.0) * (1 - cw), uniform(-1.0, 1.0) * (1 - ch)  # crop centre
        sx = torch.where(torch.rand(b, generator=generator, device=dev) < 0.5, -cw, cw)  # negative: flipped
        gx = (sx[:, None] * xs[None, :] + cx[:, None])[:, None, :].expand(b, h, w)
        gy = (ch[:, None] * ys[None, :] + cy[:, None])[:, :, None].expand(b, h, w)
        grid = torch.stack([gx, gy], dim=-1).to(x.dtype)
        return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)
    raise ValueError(f"Unknown augmentation recipe '{recipe}'; expected one of {RECIPES}.")

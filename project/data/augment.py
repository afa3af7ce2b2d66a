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
# Unset `augment`: no flips for digits (a flipped 2 is not a 2), CIFAR-10's and ImageNet's usual recipes for
# photos, nothing for FashionMNIST (its garments are centred and aligned).
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

    affine: rotation +-10 deg, scale 0.9-1.1, shift +-10% of the size, bilinear, zero fill, no flips.
    crop_flip: torchvision's RandomCrop(padding=size/8, reflect) + RandomHorizontalFlip.
    resized_crop: torchvision's RandomResizedCrop + RandomHorizontalFlip, cropped from the image at the training
    size (the only size every path has), a crop that does not fit clipped to the image instead of drawn again.
    """
    if recipe == "none":
        return x
    b, c, h, w = x.shape
    dev = x.device

    def uniform(lo: float, hi: float) -> Tensor:
        return torch.rand(b, generator=generator, device=dev) * (hi - lo) + lo

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
    # The other two: where each output pixel samples the input, as an affine map in grid_sample's [-1, 1] coords.
    if recipe == "affine":
        angle, scale = uniform(-10.0, 10.0).deg2rad(), uniform(0.9, 1.1)
        cos, sin = angle.cos() / scale, angle.sin() / scale
        rows = [[cos, -sin, uniform(-0.2, 0.2)], [sin, cos, uniform(-0.2, 0.2)]]  # coords span 2: 0.2 = 10%
        padding = "zeros"
    elif recipe == "resized_crop":
        area = uniform(*CROP_SCALE)
        ratio = uniform(*torch.tensor(CROP_RATIO).log().tolist()).exp()  # width / height, in pixels
        cw = (area * ratio * h / w).sqrt().clamp(max=1.0)  # crop width and height, fractions of the image's
        ch = (area / ratio * w / h).sqrt().clamp(max=1.0)
        cx, cy = uniform(-1.0, 1.0) * (1 - cw), uniform(-1.0, 1.0) * (1 - ch)  # crop centre
        sx = torch.where(torch.rand(b, generator=generator, device=dev) < 0.5, -cw, cw)  # negative: flipped
        zero = torch.zeros_like(cw)
        rows, padding = [[sx, zero, cx], [zero, ch, cy]], "border"
    else:
        raise ValueError(f"Unknown augmentation recipe '{recipe}'; expected one of {RECIPES}.")
    theta = torch.stack([torch.stack(row, 1) for row in rows], 1).to(x.dtype)  # (B, 2, 3)
    grid = F.affine_grid(theta, [b, c, h, w], align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode=padding, align_corners=False)

"""transforms v2 pipelines: augmentation policy per source, and normalisation from training-split statistics.

Tensor sources (digits, torchvision datasets) normalise per sample here; ImageFolder samples stay pixels
(`image_folder_transform`) and the data module normalises them a batch at a time on the device. Both use
project/data/normalize.py, as predict and export do.
"""

import torch
from torch import Tensor
from torchvision.transforms import v2

from project.data.normalize import Normalize


def channel_stats(images: Tensor) -> tuple[list[float], list[float]]:
    """Per-channel mean and std of (N, C, H, W) images, on the [0, 1] scale."""
    x = images.float() / 255.0 if images.dtype == torch.uint8 else images.float()
    mean = x.mean(dim=(0, 2, 3))
    std = x.std(dim=(0, 2, 3)).clamp_min(1e-6)
    return mean.tolist(), std.tolist()


def build_transform(
    policy: str,
    mean: list[float],
    std: list[float],
    train: bool,
    augment: bool,
    size: tuple[int, int] | None = None,
) -> v2.Compose:
    """Per-sample pipeline: to float32 in [0, 1], resize, augment (train only), normalise.

    policy: "digits" (small shifts, no flips: a flipped 2 is not a 2), "natural" (crop + flip), "none".
    """
    steps: list = [v2.ToImage(), v2.ToDtype(torch.float32, scale=True)]
    if size is not None:
        steps.append(v2.Resize(size, antialias=True))
    if train and augment:
        if policy == "digits":
            steps.append(v2.RandomAffine(degrees=10, translate=(0.1, 0.1), scale=(0.9, 1.1)))
        elif policy == "natural":
            if size is not None:
                steps.append(v2.RandomCrop(size, padding=min(size) // 8, padding_mode="reflect"))
            steps.append(v2.RandomHorizontalFlip())
    steps.append(Normalize(mean, std))
    return v2.Compose(steps)


# RandomResizedCrop's area range: torchvision's ImageNet recipe (and scripts/bench_decode.py's reference)
CROP_SCALE = (0.08, 1.0)


def image_folder_transform(train: bool, augment: bool, size: tuple[int, int]) -> v2.Compose:
    """ImageFolder's per-sample pipeline on the (3, H, W) uint8 tensors of project/data/decode.py, unnormalised.

    Training with augment: RandomResizedCrop(size, scale=CROP_SCALE) + RandomHorizontalFlip on uint8, so the batch
    stays uint8 (4x smaller to collate, pin and copy) and the crop is resized, not the whole image. Evaluation, and
    training without augment: to float in [0, 1] and Resize(size), the operations predict repeats
    (project/inference.py), so its inputs equal the evaluation inputs bit for bit.
    """
    if train and augment:
        return v2.Compose(
            [v2.RandomResizedCrop(size, scale=CROP_SCALE, antialias=True), v2.RandomHorizontalFlip()]
        )
    return v2.Compose([v2.ToDtype(torch.float32, scale=True), v2.Resize(size, antialias=True)])

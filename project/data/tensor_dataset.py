"""A map-style dataset over images held in one tensor, and stratified index splits."""

import warnings
from collections.abc import Callable

import torch
from sklearn.model_selection import train_test_split
from torch import Tensor
from torch.utils.data import Dataset


class ImageTensorDataset(Dataset):
    """(N, C, H, W) images (uint8, or float in [0, 1]) with integer labels, and an optional transform."""

    def __init__(self, images: Tensor, labels: Tensor, transform: Callable | None = None) -> None:
        if images.dtype == torch.float64:
            # float64 batches silently run a float64 model path (or fail against float32 weights): halve it here.
            warnings.warn("ImageTensorDataset got float64 images; converting to float32.", stacklevel=2)
            images = images.float()
        self.images, self.labels, self.transform = images, labels.long(), transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[Tensor, int]:
        x = self.images[i]
        return (self.transform(x) if self.transform else x), int(self.labels[i])


def stratified_split(labels: Tensor | list[int], fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Split indices 0..N-1 into (rest, held_out), `fraction` of them held out, class ratios preserved."""
    index = list(range(len(labels)))
    if fraction <= 0:
        return index, []
    rest, held = train_test_split(index, test_size=fraction, stratify=list(map(int, labels)), random_state=seed)
    return sorted(rest), sorted(held)

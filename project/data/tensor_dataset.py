"""A map-style dataset over images held in one tensor: the DataLoader path of the tensor sources."""

import warnings

import torch
from torch import Tensor
from torch.utils.data import Dataset


class ImageTensorDataset(Dataset):
    """(N, C, H, W) pixels (uint8, or float in [0, 1]) with integer labels: sample i is (images[i], label).

    The pixels are served as they are; the data module augments and normalises whole batches on the device
    (project/data/base.py), as on every other path.
    """

    def __init__(self, images: Tensor, labels: Tensor) -> None:
        if images.dtype == torch.float64:
            # float64 batches silently run a float64 model path (or fail against float32 weights): halve it here.
            warnings.warn("ImageTensorDataset got float64 images; converting to float32.", stacklevel=2)
            images = images.float()
        self.images, self.labels = images, labels.long()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[Tensor, int]:
        return self.images[i], int(self.labels[i])

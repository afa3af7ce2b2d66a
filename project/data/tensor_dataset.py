"""A map-style dataset over images held in one tensor, and stratified index splits."""

import math
import warnings
from collections.abc import Callable

import torch
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
    """Split indices 0..N-1 into (rest, held_out), `fraction` of them held out, class ratios preserved.

    ceil(fraction * N) indices are held out (as scikit-learn's train_test_split counts), shared among the classes
    in proportion to their sizes (largest remainders get the leftover places); within each class the members
    are drawn by a permutation seeded by `seed`, so the same seed gives the same split on every machine.
    Raises ValueError when a class has fewer than 2 members or either side would be smaller than the number
    of classes.
    """
    labels = torch.as_tensor(
        labels if isinstance(labels, Tensor) else list(map(int, labels)), dtype=torch.long
    )
    n = len(labels)
    if fraction <= 0:
        return list(range(n)), []
    classes, counts = torch.unique(labels, return_counts=True)
    n_held = math.ceil(fraction * n)
    if counts.min() < 2:
        rare = int(classes[counts.argmin()])
        raise ValueError(
            f"class {rare} has {int(counts.min())} member; stratifying needs at least 2 per class."
        )
    if min(n_held, n - n_held) < len(classes):
        raise ValueError(
            f"holding out {n_held} of {n} samples leaves a side with fewer samples than the {len(classes)} classes."
        )
    share = counts.double() * n_held / n
    held_per_class = share.floor().long()
    leftover = n_held - int(held_per_class.sum())
    order = sorted(range(len(classes)), key=lambda c: (-(share[c] - held_per_class[c]).item(), c))
    for c in order[:leftover]:
        held_per_class[c] += 1
    g = torch.Generator().manual_seed(seed)
    held: list[int] = []
    for c, k in zip(classes.tolist(), held_per_class.tolist()):
        members = torch.nonzero(labels == c).flatten()
        held += members[torch.randperm(len(members), generator=g)[:k]].tolist()
    held_set = set(held)
    return [i for i in range(n) if i not in held_set], sorted(held)

"""A map-style dataset over a list of (image file, label) samples: what torchvision's ImageFolder serves,
without its directory scan (the list comes from project/data/folder_index.py, made once and cached)."""

from collections.abc import Callable, Sequence
from typing import Any

from torch.utils.data import Dataset
from torchvision.datasets.folder import default_loader


class ImageFiles(Dataset):
    """samples[i] = (path, label) -> (transform(loader(path)), label).

    Args:
        samples: (file path, class index) pairs, in a fixed order (ImageFolder's: class, then path).
        transform: applied to what `loader` returns; None returns it as is.
        loader: opens one file; torchvision's default (PIL, converted to RGB) unless a faster decoder is given.
    """

    def __init__(
        self,
        samples: Sequence[tuple[str, int]],
        transform: Callable | None = None,
        loader: Callable[[str], Any] = default_loader,
    ) -> None:
        self.samples = list(samples)
        self.targets = [label for _, label in self.samples]
        self.transform, self.loader = transform, loader

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        path, label = self.samples[i]
        image = self.loader(path)
        return (self.transform(image) if self.transform is not None else image), label

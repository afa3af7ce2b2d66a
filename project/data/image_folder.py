"""ImageFolder data: root/train/<class>/*, root/val and root/test optional (carved from train if absent): the
layout, the decoder and the files dataset; folder_index.py lists and checks the files once."""

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import Tensor
from torch.utils.data import Dataset
from torchvision.datasets.folder import IMG_EXTENSIONS
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms.functional import pil_to_tensor

from project.data.normalize import resize
from project.errors import ConfigError

LAYOUT = "root/train/<class>/*.png|jpg (root/val/<class>/*, root/test/<class>/* optional)"


def class_folders(folder: str | Path) -> list[str]:
    """Sorted; hidden folders (.ipynb_checkpoints, ...) are not classes."""
    return sorted(e.name for e in os.scandir(folder) if e.is_dir() and not e.name.startswith("."))


def describe(root: str) -> tuple[list[str], tuple[int, int]]:
    """Class names of root/train and the (H, W) of its first image; clear errors for a bad layout."""
    train = Path(root) / "train"
    for path in (Path(root), train):
        if not path.is_dir():
            raise ConfigError(f"'{path}' does not exist. Expected {LAYOUT}. Set --data.init_args.root.")
    classes = class_folders(train)
    if not classes:
        raise ConfigError(f"'{train}' has no class folders. Expected {LAYOUT}: one folder per class.")
    for cls in classes:
        for name in sorted(os.listdir(train / cls)):
            if name.lower().endswith(IMG_EXTENSIONS) and not (train / cls / name).is_dir():
                try:
                    with Image.open(train / cls / name) as im:
                        return classes, (im.height, im.width)
                except Exception:  # reported with every other unreadable file at setup (folder_index.py)
                    continue
    raise ConfigError(f"'{train}' has class folders {classes} but no images ({', '.join(IMG_EXTENSIONS)}).")


def load_image(path: str | Path) -> Tensor:
    """An image file as a (3, H, W) uint8 RGB tensor: PIL's pixels, as ImageFolder's loader gives them."""
    try:
        x = decode_image(str(path), mode=ImageReadMode.RGB)  # JPEG, PNG: into a tensor, faster than PIL
        if x.dtype == torch.uint8 and x.ndim == 3:  # else a 16-bit PNG or an animated GIF: PIL's way below
            return x
    except RuntimeError:  # a format torchvision does not decode (BMP, TIFF, ...)
        pass
    with Image.open(path) as im:
        return pil_to_tensor(im.convert("RGB"))


def load_image_at(path: str | Path, size: tuple[int, int] | None) -> Tensor:  # at the training size
    return resize(load_image(path), size)


class ImageFiles(Dataset):
    """ImageFolder without its scan (the index made it): samples[i] = (path, label) -> (loader(path), label)."""

    def __init__(self, samples: Sequence[tuple[str, int]], loader: Callable[[str], Any]) -> None:
        self.samples, self.loader = list(samples), loader
        self.targets = [label for _, label in self.samples]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        path, label = self.samples[i]
        return self.loader(path), label

"""ImageFolder data: root/train/<class>/*, with root/val and root/test optional (carved from train if absent).

This file reads the layout (class names, image size); project/data/folder_index.py lists and checks the files
once, and project/data/image_files.py serves them.
"""

import os
from pathlib import Path

from PIL import Image
from torchvision.datasets.folder import IMG_EXTENSIONS

from project.errors import ConfigError

LAYOUT = "root/train/<class>/*.png|jpg (root/val/<class>/*, root/test/<class>/* optional)"


def describe(root: str) -> tuple[list[str], tuple[int, int]]:
    """Class names of root/train and the (H, W) of its first image; clear errors for a bad layout."""
    train = Path(root) / "train"
    if not Path(root).is_dir():
        raise ConfigError(f"data.root '{root}' does not exist. Expected {LAYOUT}. Set --data.init_args.root.")
    if not train.is_dir():
        raise ConfigError(f"'{train}' does not exist. Expected {LAYOUT}. Set --data.init_args.root.")
    classes = sorted(d.name for d in train.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not classes:
        raise ConfigError(f"'{train}' has no class folders. Expected {LAYOUT}: one folder per class.")
    for cls in classes:
        for name in sorted(os.listdir(train / cls)):  # names, not Path objects: 10x faster on 100,000 files
            if name.lower().endswith(IMG_EXTENSIONS) and not (train / cls / name).is_dir():
                try:
                    with Image.open(train / cls / name) as im:
                        return classes, (im.height, im.width)
                except Exception:  # reported with every other unreadable file at setup (folder_index.py)
                    continue
    raise ConfigError(f"'{train}' has class folders {classes} but no images ({', '.join(IMG_EXTENSIONS)}).")

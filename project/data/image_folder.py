"""ImageFolder data: root/train/<class>/*, with root/val and root/test optional (carved from train if absent)."""

from pathlib import Path

from PIL import Image
from torchvision.datasets import ImageFolder
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
        for f in sorted((train / cls).iterdir()):
            if f.suffix.lower() in IMG_EXTENSIONS:
                try:
                    with Image.open(f) as im:
                        return classes, (im.height, im.width)
                except Exception:  # reported with every other unreadable file at setup (check_images)
                    continue
    raise ConfigError(f"'{train}' has class folders {classes} but no images ({', '.join(IMG_EXTENSIONS)}).")


def split_folder(root: str, split: str, classes: list[str], transform) -> ImageFolder | None:
    """torchvision ImageFolder over root/<split>, or None when that split is absent."""
    path = Path(root) / split
    if not path.is_dir():
        return None
    try:
        ds = ImageFolder(str(path), transform=transform)
    except FileNotFoundError as err:
        raise ConfigError(f"'{path}': {err}. Expected {LAYOUT}.") from err
    if split != "train" and ds.classes != classes:
        raise ConfigError(
            f"'{path}' has classes {ds.classes}, but '{Path(root) / 'train'}' has {classes}. "
            "Every split must have the same class folders."
        )
    return ds

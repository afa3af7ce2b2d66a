"""CIFAR10, MNIST and FashionMNIST from torchvision's on-disk formats, loaded into memory as uint8 tensors."""

from pathlib import Path

import torch
from torch import Tensor

from project.errors import ConfigError

# name -> (torchvision class, input shape, folder torchvision expects under root)
DATASETS = {
    "cifar10": ("CIFAR10", (3, 32, 32), "cifar-10-batches-py"),
    "mnist": ("MNIST", (1, 28, 28), "MNIST/raw"),
    "fashionmnist": ("FashionMNIST", (1, 28, 28), "FashionMNIST/raw"),
}
CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def classes_of(name: str) -> list[str]:
    import torchvision.datasets as tvd

    return list(CIFAR10_CLASSES if name == "cifar10" else getattr(tvd, DATASETS[name][0]).classes)


def load_split(name: str, root: str, train: bool, download: bool) -> tuple[Tensor, Tensor]:
    import torchvision.datasets as tvd

    cls_name, _, folder = DATASETS[name]
    try:
        ds = getattr(tvd, cls_name)(root=root, train=train, download=download)
    except (RuntimeError, OSError) as err:  # missing or corrupt files, a failed download (URLError)
        how = (
            "The download failed: is this machine online? Otherwise copy the files there by hand."
            if download
            else "Set --data.init_args.download true on a machine with network access, or copy the files there."
        )
        raise ConfigError(
            f"{cls_name} {'train' if train else 'test'} files were not found or are corrupt under "
            f"'{Path(root) / folder}' (data.root = '{root}'). {how} ({type(err).__name__}: {err})"
        ) from err
    images = torch.as_tensor(ds.data)
    images = images.permute(0, 3, 1, 2) if images.ndim == 4 else images.unsqueeze(1)  # NHWC / NHW -> NCHW
    return images.contiguous(), torch.as_tensor(ds.targets, dtype=torch.long)

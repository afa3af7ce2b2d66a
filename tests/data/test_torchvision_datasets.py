"""torchvision sources on files the tests write in torchvision's own on-disk formats. Nothing downloads."""

import hashlib
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from project.data import ImageClassificationDataModule
from project.data.torchvision_datasets import CIFAR10_CLASSES
from project.errors import ConfigError


def write_idx(path: Path, array: np.ndarray) -> None:
    """IDX format (MNIST): magic 0x0000080N (uint8, N dims), big-endian int32 dims, raw bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    header = struct.pack(">I", 0x800 + array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def write_mnist(root: Path, folder: str = "MNIST", n_train: int = 200, n_test: int = 50) -> None:
    rng = np.random.default_rng(0)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        labels = np.arange(n) % 10
        images = rng.integers(0, 50, (n, 28, 28)) + labels[:, None, None] * 20
        write_idx(root / folder / "raw" / f"{prefix}-images-idx3-ubyte", images)
        write_idx(root / folder / "raw" / f"{prefix}-labels-idx1-ubyte", labels)


def write_cifar10(root: Path, monkeypatch, per_batch: int = 20) -> None:
    import torchvision.datasets as tvd

    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    names = [name for name, _ in tvd.CIFAR10.train_list + tvd.CIFAR10.test_list]
    for name in names:
        labels = list(np.arange(per_batch) % 10)
        data = rng.integers(0, 255, (per_batch, 3072), dtype=np.uint8)
        (folder / name).write_bytes(pickle.dumps({"data": data, "labels": labels}))
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": CIFAR10_CLASSES}))
    # torchvision verifies each file's md5 against the real release; tell it the md5s of ours instead.
    md5 = {n: hashlib.md5((folder / n).read_bytes()).hexdigest() for n in names + ["batches.meta"]}
    monkeypatch.setattr(tvd.CIFAR10, "train_list", [[n, md5[n]] for n, _ in tvd.CIFAR10.train_list])
    monkeypatch.setattr(tvd.CIFAR10, "test_list", [[n, md5[n]] for n, _ in tvd.CIFAR10.test_list])
    monkeypatch.setattr(tvd.CIFAR10, "meta", {**tvd.CIFAR10.meta, "md5": md5["batches.meta"]})


@pytest.mark.parametrize("source, folder", [("mnist", "MNIST"), ("fashionmnist", "FashionMNIST")])
def test_mnist_family_from_idx_files(tmp_path, source, folder):
    write_mnist(tmp_path, folder)
    dm = ImageClassificationDataModule(source=source, root=str(tmp_path), batch_size=16)
    assert dm.num_classes == 10 and dm.input_shape == (1, 28, 28)
    dm.setup("fit")
    assert len(dm.train_set) + len(dm.val_set) == 200 and len(dm.test_set) == 50
    pixels, _ = next(iter(dm.train_dataloader()))
    x, y = dm.on_after_batch_transfer((pixels, _), 0)  # uint8 pixels -> normalised float32
    assert (
        pixels.dtype == torch.uint8
        and x.shape == (16, 1, 28, 28)
        and x.dtype == torch.float32
        and y.max() < 10
    )


def test_cifar10_from_pickled_batches(tmp_path, monkeypatch):
    write_cifar10(tmp_path, monkeypatch)
    dm = ImageClassificationDataModule(source="cifar10", root=str(tmp_path), batch_size=8)
    assert dm.class_names[0] == "airplane" and dm.input_shape == (3, 32, 32)
    dm.setup("fit")
    assert len(dm.train_set) + len(dm.val_set) == 100 and len(dm.test_set) == 20
    x, _ = next(iter(dm.train_dataloader()))
    assert x.shape == (8, 3, 32, 32)


@pytest.mark.parametrize("source, expected", [("mnist", "MNIST/raw"), ("cifar10", "cifar-10-batches-py")])
def test_missing_files_name_the_expected_path_and_the_fix(tmp_path, source, expected):
    dm = ImageClassificationDataModule(source=source, root=str(tmp_path))
    with pytest.raises(ConfigError) as err:
        dm.setup("fit")
    message = str(err.value)
    assert str(tmp_path / expected) in message and "download true" in message


def test_source_without_root_is_a_clear_error():
    with pytest.raises(ConfigError, match="data.init_args.root"):
        ImageClassificationDataModule(source="cifar10")

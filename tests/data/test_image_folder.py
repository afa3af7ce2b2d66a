from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from project.data import ImageClassificationDataModule
from project.errors import ConfigError


def write_pngs(root: Path, split: str, classes: dict[str, int], size=(12, 10), seed=0) -> None:
    rng = np.random.default_rng(seed)
    for c, (name, n) in enumerate(classes.items()):
        folder = root / split / name
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(n):
            pixels = rng.integers(0, 60, (size[1], size[0], 3), dtype=np.uint8) + np.uint8(60 * c)
            Image.fromarray(pixels).save(folder / f"{i}.png")


def test_image_folder_carves_val_and_test_from_train(tmp_path):
    write_pngs(tmp_path, "train", {"cat": 20, "dog": 20})
    dm = ImageClassificationDataModule(source="imagefolder", root=str(tmp_path), batch_size=4)
    assert dm.class_names == ["cat", "dog"] and dm.input_shape == (3, 10, 12)
    dm.setup("fit")
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (28, 4, 8)
    batch = next(iter(dm.train_dataloader()))
    assert (
        batch[0].shape == (4, 3, 10, 12) and batch[0].dtype == torch.uint8
    )  # pixels: cropped, not normalised
    x, y = dm.on_after_batch_transfer(batch, 0)  # normalised once per batch (project/data/normalize.py)
    assert x.shape == (4, 3, 10, 12) and x.dtype == torch.float32
    assert dm.state_dict()["class_names"] == ["cat", "dog"]


def test_image_folder_uses_given_splits_and_resizes(tmp_path):
    write_pngs(tmp_path, "train", {"a": 6, "b": 6})
    write_pngs(tmp_path, "val", {"a": 2, "b": 2}, seed=1)
    write_pngs(tmp_path, "test", {"a": 3, "b": 3}, seed=2)
    dm = ImageClassificationDataModule(source="imagefolder", root=str(tmp_path), batch_size=4, image_size=16)
    dm.setup("fit")
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (12, 4, 6)
    x, _ = next(iter(dm.val_dataloader()))
    assert x.shape == (4, 3, 16, 16)


def test_missing_root_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match=r"does not exist.*root/train/<class>.*--data.init_args.root"):
        ImageClassificationDataModule(source="imagefolder", root=str(tmp_path / "nope"))


def test_no_class_folders_is_a_clear_error(tmp_path):
    (tmp_path / "train").mkdir()
    with pytest.raises(ConfigError, match="no class folders"):
        ImageClassificationDataModule(source="imagefolder", root=str(tmp_path))


def test_class_folders_without_images_is_a_clear_error(tmp_path):
    (tmp_path / "train" / "cat").mkdir(parents=True)
    (tmp_path / "train" / "cat" / "notes.txt").write_text("not an image")
    with pytest.raises(ConfigError, match="no images"):
        ImageClassificationDataModule(source="imagefolder", root=str(tmp_path))


def test_split_with_other_classes_is_a_clear_error(tmp_path):
    write_pngs(tmp_path, "train", {"a": 4, "b": 4})
    write_pngs(tmp_path, "val", {"a": 2, "c": 2})
    dm = ImageClassificationDataModule(source="imagefolder", root=str(tmp_path))
    with pytest.raises(ConfigError, match="same class folders"):
        dm.setup("fit")

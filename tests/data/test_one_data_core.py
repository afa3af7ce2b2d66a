"""One data core: the same folder gives the same splits, statistics, evaluation inputs and augmentation on every
path (files through a DataLoader, tensors in memory, the chunks `prepare` writes for streaming), and carved
splits never move with the training seed. In-process, on a small generated ImageFolder (no val/test folders, so
both are carved from train)."""

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import default_collate

from project.data import DatasetDataModule, ImageClassificationDataModule
from project.data.normalize import train_stats
from project.inference import preprocessing_of
from tests.conftest import quiet_trainer

CLASSES, PER_CLASS, SIZE = ("ant", "bee", "cat"), 14, 16
ARGS = dict(image_size=SIZE, batch_size=4, num_workers=0, val_fraction=0.2, test_fraction=0.2, split_seed=3)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """3 classes x 14 RGB PNGs of assorted sizes (none square at the training size), class-dependent colours."""
    root = tmp_path_factory.mktemp("core") / "pets"
    rng = np.random.default_rng(0)
    for k, name in enumerate(CLASSES):
        (root / "train" / name).mkdir(parents=True)
        for i in range(PER_CLASS):
            h, w = int(rng.integers(18, 40)), int(rng.integers(18, 40))
            pixels = rng.integers(0, 160, (h, w, 3)) + 40 * k
            Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(root / "train" / name / f"{i:02d}.png")
    return root


@pytest.fixture(scope="module")
def prepared(folder, tmp_path_factory) -> Path:
    from project.prepare import prepare

    out = tmp_path_factory.mktemp("core-stream") / "chunks"
    keys = ("val_fraction", "test_fraction", "split_seed", "image_size")
    prepare("imagefolder", str(out), root=str(folder), num_workers=1, **{k: ARGS[k] for k in keys})
    return out


def folder_module(folder: Path, **kw) -> ImageClassificationDataModule:
    dm = ImageClassificationDataModule(source="imagefolder", root=str(folder), **{**ARGS, **kw})
    dm.setup("fit")
    return dm


def stream_module(prepared: Path, **kw):
    from project.data import StreamingDataModule

    keep = ("batch_size", "num_workers")
    dm = StreamingDataModule(input_dir=str(prepared), **{k: ARGS[k] for k in keep}, **kw)
    dm.setup("fit")
    return dm


def two_paths(folder: Path, prepared: Path) -> tuple:
    """The same folder as files through a DataLoader and as prepared chunks."""
    return folder_module(folder), stream_module(prepared)


def fake_trainer(training: bool, epoch: int = 0, batch: int = 0, rank: int = 0) -> SimpleNamespace:
    """What on_after_batch_transfer reads of the Trainer: training or not, and where in the epoch."""
    progress = SimpleNamespace(current=SimpleNamespace(ready=batch))
    return SimpleNamespace(
        training=training,
        current_epoch=epoch,
        global_rank=rank,
        world_size=1,
        num_devices=1,
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)),
    )


def eval_inputs(dm, split: str) -> torch.Tensor:
    """A split's model inputs as evaluation gets them: the loader's batches through on_after_batch_transfer."""
    loader = dm.val_dataloader() if split == "val" else dm.test_dataloader()
    return torch.cat([dm.on_after_batch_transfer(batch, 0)[0] for batch in loader])


@pytest.mark.claim("data-one-core")
def test_splits_statistics_and_eval_inputs_are_the_same_on_every_path(folder, prepared):
    from litdata import StreamingDataset

    from project.data.image_folder import load_image
    from project.data.normalize import resize

    files, stream = two_paths(folder, prepared)
    # Split membership: the folder module's and what prepare wrote (the chunks' pixels) are
    # the same samples in the same order.
    for split in ("train", "val", "test"):
        paths = [p for p, _ in getattr(files, f"{split}_set").samples]
        pixels = torch.stack([resize(load_image(p), (SIZE, SIZE)) for p in paths])
        chunks = StreamingDataset(str(prepared / split))
        assert torch.equal(torch.stack([chunks[i]["image"] for i in range(len(chunks))]), pixels), split
    sizes = [len(files.train_set), len(files.val_set), len(files.test_set)]
    assert sum(sizes) == len(CLASSES) * PER_CLASS and min(sizes) >= len(CLASSES)

    # Statistics: one rule (training split only, at the training size), so the same numbers on every path ...
    assert files.mean == stream.mean and files.std == stream.std
    # ... and what a resume checks: the same split members on both paths (prepare records the folder's)
    assert files.state_dict()["fingerprint"] == stream.state_dict()["fingerprint"] is not None
    pixels = {p: resize(load_image(p), (SIZE, SIZE)) for p in sorted(map(str, folder.glob("train/*/*.png")))}
    train = [p for p, _ in files.train_set.samples]
    assert (files.mean, files.std) == train_stats(lambda p: pixels[p], train)
    # ... and not those of the whole train folder, which holds the carved val and test images too.
    everything = train_stats(lambda p: pixels[p], list(pixels))
    assert max(abs(a - b) for a, b in zip(everything[0], files.mean, strict=True)) > 1e-4

    # Evaluation inputs: float32, deterministic, equal on every path and equal to predict's preprocessing.
    prep = preprocessing_of({"data": files.state_dict()})
    for split in ("val", "test"):
        x = eval_inputs(files, split)
        assert x.dtype == torch.float32 and torch.equal(x, eval_inputs(files, split))
        assert torch.equal(x, eval_inputs(stream, split))
        paths = [p for p, _ in getattr(files, f"{split}_set").samples]
        predicted = []
        for p in paths:
            with Image.open(p) as im:
                predicted.append(prep.image(im))
        assert torch.equal(x, torch.stack(predicted)), split


@pytest.mark.claim("data-one-core")
def test_augmentation_is_one_recipe_with_the_same_draws_on_every_path(folder, prepared):
    files, stream = two_paths(folder, prepared)
    assert files.recipe == stream.recipe == "resized_crop"  # the ImageFolder source's recipe
    pixels = default_collate([files.train_set[i] for i in range(4)])
    outputs = []
    for dm in (files, stream):
        dm.trainer = fake_trainer(training=True, epoch=2, batch=5)
        outputs.append(dm.on_after_batch_transfer(pixels, 0)[0])
    # the same batch at the same (epoch, batch, rank): the same augmented tensor, bit for bit
    assert torch.equal(outputs[0], outputs[1])
    files.trainer = fake_trainer(training=True, epoch=2, batch=6)
    assert not torch.equal(
        files.on_after_batch_transfer(pixels, 0)[0], outputs[0]
    )  # another batch: new draws
    files.trainer = fake_trainer(training=False, epoch=2, batch=5)  # validation inside fit: never augmented
    evaluated = files.on_after_batch_transfer(pixels, 0)[0]
    files.trainer = None
    assert torch.equal(evaluated, files.on_after_batch_transfer(pixels, 0)[0])
    # A recipe named in the config is the same on every path; none turns it off everywhere.
    named = (folder_module(folder, augment="crop_flip"), stream_module(prepared, augment="crop_flip"))
    assert [dm.recipe for dm in named] == ["crop_flip", "crop_flip"]
    assert stream_module(prepared, augment="none").recipe == "none"


@pytest.mark.claim("data-one-core")
def test_the_dataloader_and_in_memory_paths_train_on_the_same_batches():
    """digits with augmentation: the training batches the model sees in a real fit, bit for bit, whichever path
    serves them."""
    import lightning as L

    from project.models import ConvNet
    from project.module import ClassificationModule

    class Record(L.Callback):
        def __init__(self) -> None:
            self.batches = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.batches.append(batch[0].clone())

    seen = []
    for in_memory in (True, False):
        L.seed_everything(0)
        dm = ImageClassificationDataModule(
            augment="affine", in_memory=in_memory, num_workers=0, batch_size=32
        )
        record = Record()
        trainer = quiet_trainer(max_epochs=2, limit_train_batches=3, limit_val_batches=0, callbacks=[record])
        trainer.fit(ClassificationModule(ConvNet(10, width=4), 10, (1, 8, 8)), datamodule=dm)
        seen.append(record.batches)
    assert len(seen[0]) == len(seen[1]) == 6
    for a, b in zip(*seen, strict=True):
        assert a.dtype == torch.float32 and torch.equal(a, b)


@pytest.mark.claim("data-one-core")
def test_carved_splits_depend_on_split_seed_only(folder, monkeypatch):
    """Every module's carved val/test: the same for any training seed or global RNG state, another for another
    split_seed."""
    import lightning as L

    from project.data.sequences import DigitPixelSequences

    def splits(seed: int, split_seed: int = 3):
        L.seed_everything(seed)
        torch.rand(7)  # whatever drew from the global RNG before
        monkeypatch.setenv("PL_GLOBAL_SEED", str(seed))
        image = folder_module(folder, split_seed=split_seed)
        any_data = DatasetDataModule(DigitPixelSequences(), split_seed=split_seed)
        any_data.setup("fit")
        return (
            [[p for p, _ in getattr(image, f"{s}_set").samples] for s in ("val", "test")],
            [list(any_data.val_set.indices), list(any_data.test_set.indices)],
        )

    first = splits(0)
    assert splits(1) == first and splits(12345) == first
    other = splits(0, split_seed=4)
    assert all(a != b for a, b in zip(other, first, strict=True))

"""ImageFolder's decoder and preprocessing (project/data/image_folder.py, normalize.py): PIL's pixels, torchvision's
resize, and one preprocessing for training, predict and export.
In-process, on a few generated files."""

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFilter
from torch.utils.data import default_collate

from project.data import ImageClassificationDataModule, image_folder
from project.inference import preprocessing_of
from tests.conftest import torchvision_resize


def photo(index: int, w: int = 500, h: int = 375) -> Image.Image:
    """A photo-like RGB image, a function of `index` alone: a colour gradient, blurred shapes, and texture from
    noise at 32, 8 and 2 pixel scales (not white noise, which would not compress like a photo)."""
    rng = np.random.default_rng(index)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    c0, c1, angle = rng.uniform(30, 220, 3), rng.uniform(30, 220, 3), rng.uniform(0, np.pi)
    t = ((xx * np.cos(angle) + yy * np.sin(angle)) / (w + h) + 0.5).clip(0, 1)[..., None]
    img = Image.fromarray((c0 * (1 - t) + c1 * t).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    for _ in range(rng.integers(8, 20)):
        x0, y0, s = rng.uniform(-0.2, 1.0) * w, rng.uniform(-0.2, 1.0) * h, rng.uniform(0.05, 0.5)
        box = [x0, y0, x0 + s * w, y0 + s * h * rng.uniform(0.5, 1.5)]
        (draw.ellipse if rng.integers(2) else draw.rectangle)(
            box, fill=tuple(int(v) for v in rng.integers(0, 256, 3))
        )
    x = np.asarray(img.filter(ImageFilter.BoxBlur(1)), dtype=np.float32)
    for scale, amp in ((32, 1.0), (8, 0.7), (2, 0.6)):
        field = Image.fromarray(rng.standard_normal((h // scale + 2, w // scale + 2)).astype(np.float32))
        texture = np.asarray(field.resize((field.width * scale, field.height * scale), Image.BICUBIC))
        x += 25 * amp * texture[:h, :w, None]
    return Image.fromarray(x.clip(0, 255).astype(np.uint8))


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> list[Path]:
    """Four natural-like 500x375 JPEGs at quality 90."""
    folder = tmp_path_factory.mktemp("photos")
    paths = []
    for i in range(4):
        path = folder / f"{i}.jpg"
        photo(i).save(path, quality=90)
        paths.append(path)
    return paths


@pytest.mark.claim("decode-matches-pil")
def test_decoder_gives_pils_pixels(photos, tmp_path):
    """load_image returns what torchvision's ImageFolder loader (PIL, converted to RGB) gives, pixel for pixel:
    JPEG (both decode with libjpeg-turbo's default accurate integer IDCT and fancy upsampling, whose SIMD paths
    are bit-exact with its C code) and PNG (lossless), RGB and grey; and BMP, which PIL decodes for it."""
    rng = np.random.default_rng(0)
    grey = (np.add.outer(np.arange(60), np.arange(80)) * 2 % 256).astype(np.uint8)
    grey = (grey + rng.integers(0, 40, grey.shape)).astype(np.uint8)
    colour = np.stack([grey, grey[::-1], 255 - grey], axis=-1)
    files = list(photos[:2])
    for name, pixels in (("grey", grey), ("rgb", colour)):
        for ext, options in ((".jpg", {"quality": 90}), (".png", {}), (".bmp", {})):
            path = tmp_path / f"{name}{ext}"
            Image.fromarray(pixels).save(path, **options)
            files.append(path)
    for path in files:
        with Image.open(path) as im:
            expected = torch.from_numpy(np.array(im.convert("RGB"))).permute(2, 0, 1)
        got = image_folder.load_image(path)
        assert got.dtype == torch.uint8 and got.shape == expected.shape, path
        assert torch.equal(got, expected), (path, (got.int() - expected.int()).abs().max())


@pytest.mark.claim("decode-same-output")
def test_resize_is_torchvisions_and_close_to_pils(photos):
    """`resize` (the training size, every path and predict) gives torchvision's v2 `resize` of the uint8 image,
    bit for bit, and differs from PIL's bilinear resize of the same image by less than PIL differs from itself with
    a bicubic filter: no quality is bought for speed."""
    from project.data.normalize import resize

    for path in photos:
        x = image_folder.load_image(path)
        for size in ((224, 224), (64, 64), (32, 48)):
            ours = resize(x, size)
            assert ours.dtype == torch.uint8 and torch.equal(ours, torchvision_resize(x, size))
            with Image.open(path) as im:
                rgb = im.convert("RGB")
                pil = {
                    f: torch.from_numpy(np.array(rgb.resize(size[::-1], f))).permute(2, 0, 1).float()
                    for f in (Image.BILINEAR, Image.BICUBIC)
                }
            filters = (pil[Image.BILINEAR] - pil[Image.BICUBIC]).abs().mean()
            assert (ours.float() - pil[Image.BILINEAR]).abs().mean() < filters, (path, size)


@pytest.mark.claim("normalize-one-function")
def test_training_and_predict_normalise_alike(photos, tmp_path):
    """The model input of the same file is the same tensor, bit for bit, whether it comes through training's
    loader + on_after_batch_transfer or predict's preprocessing (export's preprocessing.json is predict's)."""
    root = tmp_path / "folder"
    for split, count in (("train", 6), ("test", 2)):
        for c in ("a", "b"):
            (root / split / c).mkdir(parents=True)
            for n in range(count):
                source = photos[(n + (c == "b")) % len(photos)]
                (root / split / c / f"{n}.jpg").write_bytes(source.read_bytes())
    args = dict(source="imagefolder", root=str(root), image_size=32, batch_size=4, num_workers=0)
    dm = ImageClassificationDataModule(augment="none", val_fraction=0.25, **args)
    dm.setup("fit")
    prep = preprocessing_of({"data": dm.state_dict()})

    def predicted(paths):
        out = []
        for p in paths:
            with Image.open(p) as im:
                out.append(prep.image(im))
        return torch.stack(out)

    # training (augment off), and the test split as Trainer.test sees it
    train_paths = [p for p, _ in dm.train_set.samples[:4]]
    x, _ = dm.on_after_batch_transfer(default_collate([dm.train_set[i] for i in range(4)]), 0)
    assert x.dtype == torch.float32 and torch.equal(x, predicted(train_paths))
    test_x, _ = dm.on_after_batch_transfer(next(iter(dm.test_dataloader())), 0)
    test_paths = [p for p, _ in dm.test_set.samples]
    assert torch.equal(test_x, predicted(test_paths))

    # training with augmentation: uint8 pixels at the training size through the loader, normalised by the same
    # function per batch (augmented before that, on the device, in training only)
    dm_aug = ImageClassificationDataModule(augment="resized_crop", val_fraction=0.25, **args)
    dm_aug.setup("fit")
    pixels, _ = next(iter(dm_aug.train_dataloader()))
    assert pixels.dtype == torch.uint8 and pixels.shape == (4, 3, 32, 32)
    x, _ = dm_aug.on_after_batch_transfer((pixels, torch.zeros(4)), 0)
    assert torch.equal(x, prep.tensor(pixels))

"""`python -m project predict`: the checkpoint's own preprocessing and predictions, as a CSV; unreadable files
skipped and listed; weights read with weights_only=True."""

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from PIL import Image

from project.checkpoint import read_checkpoint
from project.data import ImageClassificationDataModule
from project.data.digits import load_digits_tensors
from project.inference import Preprocessing, build_model, preprocessing_of
from tests.conftest import run_cli, torchvision_resize
from tests.test_export import trapped_checkpoint
from tests.trained_run import trained_run

# |CSV probability - the reference softmax|: 5e-7 is the CSV's rounding (6 decimals); 1e-6 covers float32
# noise between predict's pipeline (the training transform redone in torch, batches of 64) and the reference's (its own
# arithmetic, one batch), with default kernels, ONEDNN_MAX_CPU_ISA=AVX2 and SSE41 and ATEN_CPU_CAPABILITY=default:
# that noise stays under half of 1e-6 for a fully trained default model (sharper logits) and far under it for this
# test's 10-step model (at most 4.2e-7 and 3.7e-8 on those paths).
PROB_TOL = 5e-7 + 1e-6


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return trained_run(tmp_path_factory)


def _test_split(run_dir: Path):
    """The run's own data module (its config.yaml), and how many test images its test stage saw."""
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    data = ImageClassificationDataModule(**config["data"]["init_args"])
    data.setup("test")
    seen = config["trainer"]["limit_test_batches"] * config["data"]["init_args"]["batch_size"]
    return data, seen


@pytest.mark.claim("predict-preprocessing")
def test_predict_reproduces_the_test_accuracy(run_dir, tmp_path):
    """The test split as PNG files: 8x8 'L' and 'RGB' (no resize), 16x16 'L' and 32x32 'RGB' (resized)."""
    data, seen = _test_split(run_dir)
    images, labels = data.tensors["test"]
    images, labels = images[:seen], labels[:seen]  # what the run's test stage (summary.json) measured
    pixels = (
        (images[:, 0].numpy() * 255).round().astype(np.uint8)
    )  # 8-bit PNGs: within 0.5/255 of the originals
    formats = {"8": (1, "L"), "8rgb": (1, "RGB"), "16": (2, "L"), "32rgb": (4, "RGB")}  # (upscale, mode)
    for name, (factor, mode) in formats.items():
        (tmp_path / "in" / name).mkdir(parents=True)
        for i, p in enumerate(
            pixels
        ):  # NEAREST by an integer factor: each pixel becomes a factor x factor block
            Image.fromarray(np.kron(p, np.ones((factor, factor), np.uint8))).convert(mode).save(
                tmp_path / "in" / name / f"{i:03d}.png"
            )
    summary = json.loads((run_dir / "summary.json").read_text())
    ckpt = summary["best_checkpoint"]  # the checkpoint whose test accuracy summary.json holds
    out = tmp_path / "pred.csv"
    assert run_cli("predict", "--ckpt_path", ckpt, "--input", tmp_path / "in", "--output", out) == 0
    rows = {tuple(Path(r["path"]).parts[-2:]): r for r in csv.DictReader(out.open())}
    assert len(rows) == len(formats) * seen

    # The reference: decoded here, resized as in training (bilinear, antialiased, on 8 bits), normalised with the
    # training split's statistics from the data module (not from the checkpoint), the module's own forward.
    module = build_model(read_checkpoint(ckpt))
    mean = torch.tensor(data.mean).view(1, -1, 1, 1)
    std = torch.tensor(data.std).view(1, -1, 1, 1)
    for name, (factor, _) in formats.items():
        x = torch.from_numpy(np.kron(pixels, np.ones((factor, factor), np.uint8)))[:, None]
        if factor != 1:  # training resizes the 8-bit pixels (torch's uint8 kernel), then scales to [0, 1]
            x = F.interpolate(x, size=(8, 8), mode="bilinear", antialias=True, align_corners=False)
        x = x.float() / 255
        with torch.inference_mode():
            probs = module((x - mean) / std).softmax(dim=-1)
        p, idx = probs.max(dim=-1)
        got = [rows[(name, f"{i:03d}.png")] for i in range(seen)]
        assert [r["class"] for r in got] == [data.class_names[i] for i in idx]
        assert max(abs(float(r["probability"]) - q) for r, q in zip(got, p.tolist(), strict=True)) <= PROB_TOL
        if factor == 1:
            # No resize: the PNGs differ from the float images the test stage saw only by 8-bit rounding
            # (at most 0.5/255), which changed none of the 360 test predictions, for this test's model and a
            # fully trained one, with each kernel path named above.
            correct = sum(
                r["class"] == data.class_names[y] for r, y in zip(got, labels.tolist(), strict=True)
            )
            assert correct / seen == summary["test_acc"], name


@pytest.mark.claim("predict-preprocessing", "tools-start-fast")
def test_preprocessing_gives_the_training_eval_tensors(run_dir):
    """predict's torch-only preprocessing against training's evaluation inputs and against torchvision's ops
    (pil_to_tensor, resize, Normalize): the same tensors, bit for bit, on the whole test split and on decoded
    images that need a resize, grey and RGB."""
    from torchvision.transforms import v2
    from torchvision.transforms.v2 import functional as F2

    data, _ = _test_split(run_dir)
    prep = preprocessing_of(read_checkpoint(run_dir / "checkpoints/last.ckpt"))
    images, _ = data.tensors["test"]
    assert len(images) == len(data.test_set) == 360  # digits: a stratified 20% of 1,797 images
    evaluated = torch.cat([data.on_after_batch_transfer(b, 0)[0] for b in data.test_dataloader()])
    for i in range(len(images)):
        assert torch.equal(prep.tensor(images[i]), evaluated[i]), i

    pixels = (images[:8, 0].numpy() * 255).round().astype(np.uint8)
    grey, rgb = prep, Preprocessing(prep.class_names, prep.mean * 3, prep.std * 3, (3, *prep.input_shape[1:]))
    for p, mode in ((grey, "L"), (rgb, "RGB")):
        size = list(p.input_shape[1:])
        norm = v2.Normalize(p.mean, p.std)

        def training(im, size=size, norm=norm):
            return norm(
                F2.to_dtype(torchvision_resize(F2.pil_to_tensor(im), size), torch.float32, scale=True)
            )

        for factor in (1, 2, 3, 4):  # 8x8 as saved, and larger files resized back to 8x8
            for x in pixels:
                im = Image.fromarray(np.kron(x, np.ones((factor, factor), np.uint8))).convert(mode)
                assert torch.equal(p.image(im), training(im)), (mode, factor)


@pytest.fixture
def images(tmp_path):
    """Six real digits as 8-bit PNGs (one in a subfolder), a text file and a corrupt PNG."""
    images, _ = load_digits_tensors()
    folder = tmp_path / "images"
    (folder / "sub").mkdir(parents=True)
    for i in range(6):
        path = folder / ("sub" if i == 5 else "") / f"digit{i}.png"
        Image.fromarray((images[i, 0].numpy() * 255).round().astype(np.uint8)).save(path)
    (folder / "notes.txt").write_text("not an image")
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    return folder


@pytest.mark.claim("predict-csv")
def test_predict_folder(run_dir, images, tmp_path, capsys):
    out = tmp_path / "pred.csv"
    ckpt = run_dir / "checkpoints/last.ckpt"
    assert run_cli("predict", "--ckpt_path", ckpt, "--input", images, "--output", out, "--top_k", "3") == 0
    rows = list(csv.DictReader(out.open()))
    # The fixture's six digits are predicted; its text file and corrupt PNG are the 2 skipped files.
    assert len(rows) == 6 and {r["path"].rsplit("/", 1)[1] for r in rows} == {
        f"digit{i}.png" for i in range(6)
    }
    for r in rows:
        assert r["class"] in [str(d) for d in range(10)]  # the class names saved at training
        top = [pair.split(":") for pair in r["top3"].split(";")]
        assert len(top) == 3 and top[0][0] == r["class"] and 0.0 < float(r["probability"]) <= 1.0
        assert float(top[0][1]) >= float(top[1][1]) >= float(top[2][1])
    err = capsys.readouterr().err
    assert "Skipped 2 file(s)" in err and "broken.png" in err and "notes.txt" in err


@pytest.mark.claim("predict-csv")
def test_predict_single_file_default_output(run_dir, images):
    assert (
        run_cli("predict", "--ckpt_path", run_dir / "checkpoints/last.ckpt", "--input", images / "digit0.png")
        == 0
    )
    rows = list(csv.DictReader((run_dir / "predictions.csv").open()))
    assert len(rows) == 1 and rows[0]["path"].endswith("digit0.png")


def test_predict_errors_name_the_fix(run_dir, tmp_path, capsys):
    assert run_cli("predict", "--ckpt_path", tmp_path / "nope.ckpt", "--input", tmp_path) == 2
    assert "CKPT=runs/<run>/checkpoints/last.ckpt" in capsys.readouterr().err
    assert (
        run_cli("predict", "--ckpt_path", run_dir / "checkpoints/last.ckpt", "--input", tmp_path / "missing")
        == 2
    )


@pytest.mark.claim("safe-loading")
def test_predict_refuses_pickled_code(run_dir, images, tmp_path, capsys):
    ckpt, marker = trapped_checkpoint(run_dir / "checkpoints/last.ckpt", tmp_path)
    assert run_cli("predict", "--ckpt_path", ckpt, "--input", images, "--output", tmp_path / "p.csv") == 2
    assert not marker.exists()  # the pickled call never ran
    assert "weights_only=True" in capsys.readouterr().err
    assert not (tmp_path / "p.csv").exists()

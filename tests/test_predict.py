"""`python -m project predict`: a CSV of class names and probabilities; unreadable files skipped and listed."""

import csv

import numpy as np
import pytest
from PIL import Image

from project.data.digits import load_digits_tensors
from tests.conftest import run_cli
from tests.trained_run import trained_run


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return trained_run(tmp_path_factory)


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


def test_predict_folder(run_dir, images, tmp_path, capsys):
    out = tmp_path / "pred.csv"
    ckpt = run_dir / "checkpoints/last.ckpt"
    assert run_cli("predict", "--ckpt_path", ckpt, "--input", images, "--output", out, "--top_k", "3") == 0
    rows = list(csv.DictReader(out.open()))
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

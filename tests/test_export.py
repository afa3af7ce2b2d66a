"""`python -m project export`: ONNX (dynamic batch) and torch.export programs match eager PyTorch; a model
that torch.export cannot trace is refused with the reason; weights are read with weights_only=True."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from project.checkpoint import read_checkpoint
from project.export import TOLERANCE
from project.inference import build_model
from project.models import ConvNet
from tests.conftest import run_cli
from tests.trained_run import trained_run

assert TOLERANCE == 1e-4  # the README's promise ("must be <= 1e-4"), used below as the test's tolerance


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return trained_run(tmp_path_factory)


def _max_diff_lines(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if "max abs diff" in ln]


def _compare_outside(model, onnx_path: Path, run_program) -> None:
    """The written files, loaded as a user would, against eager PyTorch on batch sizes export never used."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    for batch in (1, 7):  # export traces with batch 2: another size proves the batch axis is dynamic
        x = torch.randn(batch, 1, 8, 8)  # digits: grey 8x8 images, 10 classes
        with torch.no_grad():
            expected, got_program = model(x).numpy(), run_program(x).numpy()
        got_onnx = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
        assert got_onnx.shape == got_program.shape == expected.shape == (batch, 10)
        assert np.abs(got_onnx - expected).max() <= TOLERANCE
        assert np.abs(got_program - expected).max() <= TOLERANCE


@pytest.mark.slow
@pytest.mark.claim("export-checked")
def test_export_default_model(run_dir, tmp_path, capsys):
    out = tmp_path / "export"
    assert run_cli("export", "--ckpt_path", run_dir / "checkpoints/last.ckpt", "--out_dir", out) == 0
    # Both programs were checked inside export on 3 inputs each (random batches of 1, 5 and 64).
    lines = _max_diff_lines(capsys.readouterr().out)
    assert len(lines) == 2 * 3
    assert all(float(ln.rsplit(" ", 1)[1]) <= TOLERANCE for ln in lines)
    prep = json.loads((out / "preprocessing.json").read_text())
    # digits: classes "0".."9", grey 8x8 images (project/data/digits.py)
    assert prep["class_names"] == [str(d) for d in range(10)] and prep["input_shape"] == [1, 8, 8]
    assert len(prep["mean"]) == len(prep["std"]) == 1
    model = build_model(read_checkpoint(run_dir / "checkpoints/last.ckpt")).model.eval()
    _compare_outside(model, out / "model.onnx", torch.export.load(out / "model.pt2").module())


class DataDependentConvNet(ConvNet):
    """ConvNet behind a data-dependent Python `if`: torch.export cannot decide the branch on symbolic values."""

    def forward(self, x):
        out = super().forward(x)
        return out if x.mean() > 0 else -out


@pytest.mark.claim("export-checked")
def test_export_refuses_an_untraceable_model_in_one_paragraph(run_dir, tmp_path, capsys):
    checkpoint = read_checkpoint(run_dir / "checkpoints/last.ckpt")
    checkpoint["hyper_parameters"]["model"]["class_path"] = f"{__name__}.DataDependentConvNet"
    torch.save(checkpoint, tmp_path / "dd.ckpt")
    args = ("--ckpt_path", tmp_path / "dd.ckpt", "--out_dir", tmp_path / "out", "--allow_class", __name__)
    assert run_cli("export", *args) == 2
    assert "Exporting DataDependentConvNet failed" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing half-written


def _spring(path: str) -> None:
    """What full unpickling of a Trap runs (importing this module and calling this function)."""
    Path(path).write_text("pickled code ran")


class Trap:
    """An object whose unpickling calls _spring: weights_only=True must refuse it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (_spring, (str(self.path),))


def trapped_checkpoint(ckpt: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of a real checkpoint plus a Trap; returns (checkpoint, the file the trap would write)."""
    checkpoint, marker = read_checkpoint(ckpt), tmp_path / "sprung.txt"
    checkpoint["note"] = Trap(marker)
    torch.save(checkpoint, tmp_path / "trapped.ckpt")
    return tmp_path / "trapped.ckpt", marker


@pytest.mark.claim("safe-loading")
def test_export_refuses_pickled_code(run_dir, tmp_path, capsys):
    ckpt, marker = trapped_checkpoint(run_dir / "checkpoints/last.ckpt", tmp_path)
    assert run_cli("export", "--ckpt_path", ckpt, "--out_dir", tmp_path / "export") == 2
    assert not marker.exists()  # the pickled call never ran
    assert "weights_only=True" in capsys.readouterr().err
    assert not (tmp_path / "export").exists()

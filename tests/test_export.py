"""`python -m project export`: ONNX (dynamic batch) and torch.export programs match eager PyTorch; a model
that torch.export cannot handle falls back to TorchScript, still checked; weights are read with
weights_only=True."""

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
    # Both programs were checked inside export on 3 inputs each (random batches of 1 and 5, one test batch).
    lines = _max_diff_lines(capsys.readouterr().out)
    assert len(lines) == 2 * 3 and sum("test batch" in ln for ln in lines) == 2
    assert all(float(ln.rsplit(" ", 1)[1]) <= TOLERANCE for ln in lines)
    prep = json.loads((out / "preprocessing.json").read_text())
    # digits: classes "0".."9", grey 8x8 images (project/data/digits.py)
    assert prep["class_names"] == [str(d) for d in range(10)] and prep["input_shape"] == [1, 8, 8]
    assert len(prep["mean"]) == len(prep["std"]) == 1
    model = build_model(read_checkpoint(run_dir / "checkpoints/last.ckpt")).model.eval()
    _compare_outside(model, out / "model.onnx", torch.export.load(out / "model.pt2").module())


class DataDependentConvNet(ConvNet):
    """ConvNet behind a data-dependent Python `if`: torch.export cannot trace it (it cannot decide the branch
    on symbolic values). The branch is never taken on these inputs, so a TorchScript trace, which records the
    path taken, is faithful."""

    def forward(self, x):
        # 1e4: far above any input here (normalised digits lie within -0.82..1.85, N(0, 1) draws within +-6)
        if x.abs().amax() > 1e4:
            x = x / x.abs().amax()
        return super().forward(x)


class SignDependentConvNet(ConvNet):
    """A trace keeps one branch of this `if`: on inputs of the other sign the fallback is wrong."""

    def forward(self, x):
        out = super().forward(x)
        return out if x.mean() > 0 else -out


def _with_model(run_dir: Path, tmp_path: Path, cls: type) -> Path:
    """The trained run's checkpoint, rebuilt as `cls` (same weights: cls is a ConvNet)."""
    checkpoint = read_checkpoint(run_dir / "checkpoints/last.ckpt")
    checkpoint["hyper_parameters"]["model"]["class_path"] = f"{__name__}.{cls.__name__}"
    torch.save(checkpoint, tmp_path / f"{cls.__name__}.ckpt")
    return tmp_path / f"{cls.__name__}.ckpt"


@pytest.mark.claim("export-torchscript-fallback")
def test_export_falls_back_to_torchscript_and_checks_it(run_dir, tmp_path, capsys):
    ckpt = _with_model(run_dir, tmp_path, DataDependentConvNet)
    trust = ("--allow_class", __name__)  # the checkpoint names this test module's classes
    assert run_cli("export", "--ckpt_path", ckpt, "--out_dir", tmp_path / "ok", *trust) == 0
    out = capsys.readouterr().out
    assert "falling back to TorchScript" in out
    written = sorted(p.name for p in (tmp_path / "ok").iterdir())
    assert written == ["model.onnx", "model.ts", "preprocessing.json"]
    # ONNX (converted from the trace) and model.ts, 3 inputs each, a real test batch included
    lines = _max_diff_lines(out)
    assert sum("model.ts" in ln for ln in lines) == 3 and sum("ONNX" in ln for ln in lines) == 3
    assert sum("test batch" in ln for ln in lines) == 2
    assert all(float(ln.rsplit(" ", 1)[1]) <= TOLERANCE for ln in lines)
    model = build_model(read_checkpoint(ckpt), allow=[__name__]).model.eval()
    assert isinstance(model, DataDependentConvNet)
    _compare_outside(model, tmp_path / "ok/model.onnx", torch.jit.load(str(tmp_path / "ok/model.ts")))

    # The fallback is checked like torch.export's program: an unfaithful trace is an error, not a file.
    ckpt = _with_model(run_dir, tmp_path, SignDependentConvNet)
    assert run_cli("export", "--ckpt_path", ckpt, "--out_dir", tmp_path / "bad", *trust) == 2
    assert "not faithful" in capsys.readouterr().err


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

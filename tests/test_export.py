"""`python -m project export`: ONNX (dynamic batch) and torch.export programs match eager PyTorch."""

import json

import numpy as np
import pytest
import torch

from project.inference import build_model, load_checkpoint
from tests.conftest import run_cli
from tests.trained_run import trained_run


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return trained_run(tmp_path_factory)


def test_export_default_model(run_dir, tmp_path, capsys):
    import onnxruntime as ort

    out = tmp_path / "export"
    assert run_cli("export", "--ckpt_path", run_dir / "checkpoints/last.ckpt", "--out_dir", out) == 0
    # Both programs were checked inside export, on random batches and on a real test batch, and printed.
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "max abs diff" in ln]
    assert len(lines) == 6 and sum("test batch" in ln for ln in lines) == 2
    assert all(float(ln.rsplit(" ", 1)[1]) <= 1e-4 for ln in lines)
    prep = json.loads((out / "preprocessing.json").read_text())
    assert prep["class_names"] == [str(d) for d in range(10)] and prep["input_shape"] == [1, 8, 8]
    assert len(prep["mean"]) == len(prep["std"]) == 1
    model = build_model(load_checkpoint(run_dir / "checkpoints/last.ckpt")).model.eval()
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    program = torch.export.load(out / "model.pt2").module()
    for batch in (1, 7):  # neither is the traced batch size (2): the batch axis is dynamic
        x = torch.randn(batch, 1, 8, 8)
        with torch.no_grad():
            expected = model(x).numpy()
            got_program = program(x).numpy()
        got_onnx = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
        assert got_onnx.shape == expected.shape == (batch, 10)
        assert np.abs(got_onnx - expected).max() <= 1e-4
        assert np.abs(got_program - expected).max() <= 1e-4

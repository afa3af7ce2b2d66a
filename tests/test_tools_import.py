"""predict and export start fast: run as a user types them, they never import the training stack.

Lightning (seconds to import), torchmetrics and matplotlib belong to training; torchvision (over a second more)
only to torchvision models. Each command runs as its own process with a sitecustomize.py on PYTHONPATH that
writes the names in sys.modules when the process exits, so everything imported anywhere, C extensions and lazy
imports included, is seen.
"""

import os
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from project.data.digits import load_digits_tensors
from tests.conftest import REPO, launch
from tests.trained_run import trained_run

TRAINING_STACK = ("lightning", "pytorch_lightning", "torchmetrics", "matplotlib")
HOOK = """import atexit, os, sys
def _dump(path=os.environ["MODULES_AT_EXIT"]):
    with open(path, "w") as f:
        f.write("\\n".join(sorted(sys.modules)))
atexit.register(_dump)
"""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return trained_run(tmp_path_factory)


def _modules_at_exit(argv: list, tmp_path: Path) -> set[str]:
    hook = tmp_path / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(HOOK)
    dump = tmp_path / f"modules-{argv[0]}.txt"
    env = {
        "PYTHONPATH": os.pathsep.join([str(hook), str(REPO)]),
        "MODULES_AT_EXIT": str(dump),
        "OMP_NUM_THREADS": "1",
    }
    result = launch([sys.executable, "-m", "project", *map(str, argv)], tmp_path, env=env, timeout=180)
    assert result.returncode == 0, result
    modules = set(dump.read_text().split())
    assert {"torch", f"project.{argv[0]}"} <= modules  # the hook saw the tool run
    return modules


def _packages(modules: set[str], names: tuple[str, ...]) -> list[str]:
    return sorted({m.split(".")[0] for m in modules if m.split(".")[0] in names})


@pytest.mark.slow  # two processes
@pytest.mark.claim("tools-start-fast")
def test_predict_and_export_do_not_import_the_training_stack(run_dir, tmp_path):
    image = tmp_path / "digit.png"
    pixels = (load_digits_tensors()[0][0, 0].numpy() * 255).round().astype(np.uint8)
    Image.fromarray(pixels).save(image)
    ckpt = run_dir / "checkpoints/last.ckpt"  # the default ConvNet

    predict = _modules_at_exit(
        ["predict", "--ckpt_path", ckpt, "--input", image, "--output", tmp_path / "p.csv"], tmp_path
    )
    assert _packages(predict, (*TRAINING_STACK, "torchvision")) == []
    assert (tmp_path / "p.csv").exists()

    export = _modules_at_exit(["export", "--ckpt_path", ckpt, "--out_dir", tmp_path / "export"], tmp_path)
    assert _packages(export, TRAINING_STACK) == []
    assert (tmp_path / "export/model.onnx").exists()

"""Loading a checkpoint imports no code that the checkpoint names, unless the user allows it (--allow_class).

The crafted checkpoints below are real ones whose stored hyperparameters name `untrusted_payload`, a module on
PYTHONPATH that writes a file when it is imported: that file must never appear, and the command must end with one
paragraph that names the flag. `python -m project predict/export` run in this process, the payload's folder on
sys.path and the module not yet imported (asserted), so that the marker tells whether it was.
"""

import copy
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from project.checkpoint import check_class_paths, read_checkpoint
from project.errors import ConfigError
from project.inference import build_model, load_model
from tests.conftest import run_cli
from tests.trained_run import trained_run

PAYLOAD = "untrusted_payload"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return trained_run(tmp_path_factory)


@pytest.fixture
def payload(tmp_path):
    """A module that writes `marker` when imported (and then offers the ConvNet as `Model`); its folder."""
    folder, marker = tmp_path / "pythonpath", tmp_path / "payload-imported.txt"
    folder.mkdir()
    (folder / f"{PAYLOAD}.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('imported')\n"
        "from project.models import ConvNet as Model\n"
    )
    yield folder, marker
    sys.modules.pop(PAYLOAD, None)  # imported where a test allows it: the next test starts without it


def _crafted(run_dir: Path, tmp_path: Path, edit) -> tuple[Path, dict]:
    checkpoint = read_checkpoint(run_dir / "checkpoints/last.ckpt")
    edit(checkpoint)
    path = tmp_path / "run/checkpoints/crafted.ckpt"
    path.parent.mkdir(parents=True)
    torch.save(checkpoint, path)
    return path, checkpoint


def _nested_model(checkpoint: dict) -> None:
    checkpoint["hyper_parameters"]["model"]["class_path"] = f"{PAYLOAD}.Model"


@dataclass
class Tool:
    returncode: int
    stderr: str


def _tool(argv: list, capsys) -> Tool:
    """`python -m project ARGV` in this process: its exit code and what it printed on stderr."""
    assert PAYLOAD not in sys.modules
    capsys.readouterr()
    code = run_cli(*argv)
    return Tool(code, capsys.readouterr().err)


def _one_paragraph(stderr: str) -> str:
    text = stderr.strip()
    assert text.startswith("error: ") and "\n\n" not in text and "Traceback" not in text, stderr
    return text


@pytest.mark.claim("checkpoint-names-no-code")
def test_predict_and_export_refuse_a_class_the_checkpoint_names(
    run_dir, payload, tmp_path, monkeypatch, capsys
):
    folder, marker = payload
    monkeypatch.syspath_prepend(str(folder))
    images = tmp_path / "images"
    images.mkdir()
    from PIL import Image

    Image.new("L", (8, 8), 128).save(images / "grey.png")
    ckpt, _ = _crafted(run_dir, tmp_path, _nested_model)
    # A config.yaml beside the checkpoint that names the payload too: the tools do not read it.
    (ckpt.parent.parent / "config.yaml").write_text(
        f"model:\n  init_args:\n    model:\n      class_path: {PAYLOAD}.Model\n"
    )

    predict = _tool(
        ["predict", "--ckpt_path", ckpt, "--input", images, "--output", tmp_path / "p.csv"], capsys
    )
    assert predict.returncode == 2, predict
    assert not marker.exists()  # the payload was never imported
    paragraph = _one_paragraph(predict.stderr)
    assert f"{PAYLOAD}.Model (at model.class_path)" in paragraph
    assert f"--allow_class {PAYLOAD}.Model" in paragraph  # the fix
    assert not (tmp_path / "p.csv").exists()

    export = _tool(["export", "--ckpt_path", ckpt, "--out_dir", tmp_path / "export"], capsys)
    assert export.returncode == 2, export
    assert not marker.exists()
    assert f"--allow_class {PAYLOAD}.Model" in _one_paragraph(export.stderr)
    assert not (tmp_path / "export").exists()

    # The fix works: with the flag the named module is imported (here it is the ConvNet under another name).
    allowed = _tool(
        ["predict", "--ckpt_path", ckpt, "--input", images, "--output", tmp_path / "p.csv"]
        + ["--allow_class", PAYLOAD],
        capsys,
    )
    assert allowed.returncode == 0, allowed
    assert marker.exists() and (tmp_path / "p.csv").exists()


def _top_level(checkpoint: dict) -> None:
    checkpoint["hyper_parameters"]["_class_path"] = f"{PAYLOAD}.Module"


def _optimizer(
    checkpoint: dict,
) -> None:  # the optimizer config is checked although predict builds no optimizer
    checkpoint["hyper_parameters"]["optimizer"] = {"class_path": f"{PAYLOAD}.Optimizer", "init_args": {}}


def _deep(checkpoint: dict) -> None:  # a class path nested in a list inside the model's arguments
    model = checkpoint["hyper_parameters"]["model"]
    model["init_args"]["blocks"] = [{"class_path": "torch.nn.ReLU"}, {"class_path": f"{PAYLOAD}.Block"}]


def _dotted_string(checkpoint: dict) -> None:  # jsonargparse imports a string given for a callable's type
    checkpoint["hyper_parameters"]["scheduler"] = f"{PAYLOAD}.schedule"


@pytest.mark.claim("checkpoint-names-no-code")
@pytest.mark.parametrize("edit", [_nested_model, _top_level, _optimizer, _deep, _dotted_string])
def test_every_class_path_is_checked_before_import(run_dir, payload, tmp_path, monkeypatch, edit):
    folder, marker = payload
    monkeypatch.syspath_prepend(str(folder))
    _, checkpoint = _crafted(run_dir, tmp_path, edit)
    builders = [build_model] if edit is _dotted_string else [load_model, build_model]
    for build in builders:
        with pytest.raises(ConfigError, match=f"--allow_class {PAYLOAD}"):
            build(copy.deepcopy(checkpoint), "crafted.ckpt")
    assert not marker.exists() and PAYLOAD not in sys.modules


def test_own_checkpoints_rebuild_without_flags(run_dir):
    """The allowlist covers what the template's own configs name (model, module, optimizer, schedule)."""
    checkpoint = read_checkpoint(run_dir / "checkpoints/last.ckpt")
    model = load_model(checkpoint)
    assert not model.training
    torch.testing.assert_close(
        model.state_dict(), build_model(checkpoint).model.state_dict(), rtol=0, atol=0
    )  # the same weights by either route


@pytest.mark.claim("checkpoint-names-no-code")
def test_the_allowlist_refuses_look_alike_prefixes():
    """An entry allows itself and what is inside it (a dot follows), never a name that only starts alike."""
    allowed = ["project.models.ConvNet", "torch.nn.ReLU", "torchvision.models.resnet18", "torch.optim.AdamW"]
    allowed += ["my_models.TinyMLP", "my_models.sub.Block", "trusted.Model"]
    refused = ["projectx.evil.Model", "torch.nn_evil.X", "torchvision.modelsx.Y", "torch.optimizer.Z"]
    refused += ["my_models_evil.TinyMLP", "trusted.ModelEvil", "trustedx.Model", "my_models", "os.system"]
    for name in allowed:
        check_class_paths({"model": {"class_path": name}}, ["my_models", "trusted.Model"])
    for name in refused:
        with pytest.raises(ConfigError, match="outside the allowlist"):
            check_class_paths({"model": {"class_path": name}}, ["my_models", "trusted.Model"])

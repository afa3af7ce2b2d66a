"""The predict/export contract with a user's own LightningDataModule (docs/data.md "Predict and export"): its
state_dict() returns class_names, input_shape, mean and std. With them, `fit` names make predict and make export,
and both work; without mean and std, `fit` prints one note and
predict and export stop with one paragraph that names the missing keys and the fix.

The data module is the user's: a file this test writes, importing only Lightning and torch."""

import csv

import pytest
from PIL import Image

from tests.conftest import CONFIGS, QUIET, run_cli

USER_DATA = '''
import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

MEAN, STD = [0.5, 0.5, 0.5], [0.25, 0.25, 0.25]


class Blobs(L.LightningDataModule):
    """3 classes of 3x8x8 images in memory (the brightest channel is the class), normalised here."""

    class_names = ["red", "green", "blue"]
    num_classes, in_channels, input_shape = 3, 3, (3, 8, 8)  # what the CLI links to the model

    def setup(self, stage=None):
        y = torch.arange(300) % 3
        x = torch.rand(300, 3, 8, 8, generator=torch.Generator().manual_seed(0)) * 0.5
        x[torch.arange(300), y] += 0.5
        x = (x - torch.tensor(MEAN).view(3, 1, 1)) / torch.tensor(STD).view(3, 1, 1)
        self.sets = {"train": (x[:200], y[:200]), "val": (x[200:250], y[200:250]), "test": (x[250:], y[250:])}

    def _loader(self, split):
        return DataLoader(TensorDataset(*self.sets[split]), batch_size=32, shuffle=split == "train")

    def train_dataloader(self):
        return self._loader("train")

    def val_dataloader(self):
        return self._loader("val")

    def test_dataloader(self):
        return self._loader("test")

    def state_dict(self):
        return {"class_names": self.class_names, "input_shape": list(self.input_shape), "mean": MEAN, "std": STD}


class NoStats(Blobs):
    def state_dict(self):
        return {"class_names": self.class_names, "input_shape": list(self.input_shape)}
'''


@pytest.fixture
def user_data(in_tmp, monkeypatch):
    """contract_data.py in the (temporary) working directory, importable; a red 8x8 PNG to predict."""
    (in_tmp / "contract_data.py").write_text(USER_DATA)
    monkeypatch.syspath_prepend(str(in_tmp))
    Image.new("RGB", (8, 8), (255, 0, 0)).save(in_tmp / "red.png")
    return in_tmp


def _fit(data_class: str, run_dir, capsys) -> tuple[str, str]:
    args = ["fit", "--config", CONFIGS / "default.yaml", "--data", f"contract_data.{data_class}", *QUIET]
    assert run_cli(*args, "--trainer.max_epochs", "1", "--run_dir", run_dir) == 0
    captured = capsys.readouterr()
    return captured.out, captured.err


def _one_paragraph(stderr: str) -> str:
    text = stderr.strip()
    assert text.startswith("error: ") and "\n\n" not in text and "Traceback" not in text, stderr
    return text


@pytest.mark.slow
@pytest.mark.claim("predict-export-contract")
def test_a_user_data_module_with_the_contract_predicts_and_exports(user_data, capsys):
    out, err = _fit("Blobs", user_data / "run", capsys)
    assert "note:" not in err
    assert "make predict CKPT=" in out and "make export CKPT=" in out
    ckpt = user_data / "run/checkpoints/last.ckpt"

    assert run_cli("predict", "--ckpt_path", ckpt, "--input", user_data / "red.png") == 0
    (row,) = csv.DictReader((user_data / "run/predictions.csv").open())
    assert row["class"] in ("red", "green", "blue")

    # export reads only the data module's state: ONNX (onnxruntime) and torch.export checked, no flag needed
    assert run_cli("export", "--ckpt_path", ckpt) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "max abs diff" in ln]
    assert sum("ONNX (onnxruntime)" in ln for ln in lines) == 3
    assert (user_data / "run/export/model.onnx").is_file()


@pytest.mark.slow
@pytest.mark.claim("predict-export-contract")
def test_a_user_data_module_without_mean_and_std(user_data, capsys):
    out, err = _fit("NoStats", user_data / "run", capsys)
    notes = [ln for ln in err.splitlines() if ln.startswith("note:")]
    assert notes == [
        "note: make predict and make export need the data module's state_dict() to return mean, std "
        '(docs/data.md "Predict and export").'
    ], err
    assert "Next: make tensorboard" in out and "make predict" not in out and "make export" not in out

    ckpt = user_data / "run/checkpoints/last.ckpt"
    for tool in (["predict", "--input", user_data / "red.png"], ["export"]):
        assert run_cli(tool[0], "--ckpt_path", ckpt, *tool[1:]) == 2
        paragraph = _one_paragraph(capsys.readouterr().err)
        assert "lacks mean, std in its data module's state" in paragraph
        assert "the data module (NoStats) must return" in paragraph and "def state_dict(self):" in paragraph
        assert "make train" not in paragraph
    assert not (user_data / "run/export").exists() and not (user_data / "run/predictions.csv").exists()

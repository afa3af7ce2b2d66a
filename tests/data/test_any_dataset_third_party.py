"""DatasetDataModule on code the project did not write (docs/data.md "Any Dataset"): a torchvision dataset with its
transforms, one that yields PIL images, a dataset built by a function, and TensorDataset's positional arguments.

Each run is in-process (run_cli), 1 epoch of a few small batches, from a config the test writes.
"""

import sys

import pytest
import yaml

from tests.conftest import QUIET, read_summary, run_cli

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")

# torchvision's FakeData: random images made in __getitem__, nothing downloaded. 200 images: 40 carved for test,
# 16 for val, 144 to train: 4 batches of 32.
FAKE = {"class_path": "torchvision.datasets.FakeData"}
FAKE["init_args"] = {"size": 200, "image_size": [3, 16, 16], "num_classes": 4}
COMPOSE = {
    "class_path": "torchvision.transforms.Compose",
    "init_args": {
        "transforms": [
            {"class_path": "torchvision.transforms.ToTensor"},
            {
                "class_path": "torchvision.transforms.Normalize",
                "init_args": {"mean": [0.5] * 3, "std": [0.25] * 3},
            },
        ]
    },
}
# A torchvision model class whose constructor has no in_channels: the data module's in_channels (None for
# FakeData, which does not say its channel count) is linked to nothing.
MOBILENET = ["--model.init_args.model", "torchvision.models.MobileNetV2"]
ONE_EPOCH = [*QUIET, "--trainer.max_epochs", "1", "--run_dir", "runs/r"]


def write_config(path, train: dict, **init_args) -> str:
    data = {"class_path": "project.data.DatasetDataModule"}
    data["init_args"] = {"train": train, "batch_size": 32, "num_workers": 0, **init_args}
    path.write_text(yaml.safe_dump({"data": data}))
    return str(path)


def fit(config: str, *flags: str) -> int:
    return run_cli("fit", "--config", config, *ONE_EPOCH, *flags)


def error_lines(capsys) -> list[str]:
    """What the CLI printed after `error: ` (on stderr, below "Loading torch and Lightning...")."""
    return capsys.readouterr().err.split("\nerror: ", 1)[-1].strip().splitlines()


def error_paragraph(capsys) -> str:
    return " ".join(" ".join(error_lines(capsys)).split())


@pytest.mark.claim("any-dataset-third-party")
def test_torchvision_dataset_with_its_transforms_trains(in_tmp):
    train = {**FAKE, "init_args": {**FAKE["init_args"], "transform": COMPOSE}}
    assert fit(write_config(in_tmp / "fake.yaml", train), *MOBILENET) == 0
    summary = read_summary(in_tmp / "runs/r")
    assert (summary["epochs"], summary["global_step"]) == (1, 4) and 0 <= summary["test_acc"] <= 1, summary
    recorded = yaml.safe_load((in_tmp / "runs/r/config.yaml").read_text())["data"]["init_args"]["train"]
    assert recorded["init_args"]["transform"]["init_args"]["transforms"][1]["class_path"].endswith(
        "Normalize"
    )


@pytest.mark.claim("any-dataset-third-party")
def test_pil_images_stop_before_training_with_the_fix(in_tmp, capsys):
    config = write_config(in_tmp / "pil.yaml", FAKE)
    assert fit(config, *MOBILENET) == 2
    err = error_paragraph(capsys)
    assert "Traceback" not in err and not (in_tmp / "runs/r/summary.json").exists()
    assert "The train dataset torchvision.datasets.fakedata.FakeData yields PIL images" in err, err
    assert "transform: {class_path: torchvision.transforms.ToTensor}" in err
    # The flag the paragraph gives is the fix.
    flag = "--data.init_args.train.init_args.transform torchvision.transforms.ToTensor"
    assert flag in err
    assert fit(config, *MOBILENET, *flag.split()) == 0
    assert read_summary(in_tmp / "runs/r")["global_step"] == 4


# The factory function the TensorDataset error shows (test_tensor_dataset_positional_arguments_name_the_factory).
FACTORY = (
    "def make_dataset(n: int = 100) -> Dataset: return TensorDataset(torch.randn(n, 8), torch.arange(n) % 2)"
)
MY_DATA = f"""
import torch
from torch.utils.data import Dataset, TensorDataset

{FACTORY}
"""
# A linear model on the 8 features; no in_channels, no images.
LINEAR = ["--model.init_args.model", "torch.nn.Linear", "--model.init_args.channels_last", "false"]
LINEAR += [
    "--model.init_args.model.init_args.in_features",
    "8",
    "--model.init_args.model.init_args.out_features",
    "2",
]


@pytest.fixture
def my_data(in_tmp, monkeypatch):
    (in_tmp / "my_data.py").write_text(MY_DATA)
    monkeypatch.syspath_prepend(str(in_tmp))
    monkeypatch.delitem(sys.modules, "my_data", raising=False)  # another test's my_data.py, imported before


@pytest.mark.claim("any-dataset-factory")
def test_dataset_built_by_a_function_trains(in_tmp, my_data):
    train = {"class_path": "my_data.make_dataset", "init_args": {"n": 200}}
    assert fit(write_config(in_tmp / "factory.yaml", train, num_classes=2), *LINEAR) == 0
    summary = read_summary(in_tmp / "runs/r")
    assert (summary["epochs"], summary["global_step"]) == (1, 4), summary
    recorded = yaml.safe_load((in_tmp / "runs/r/config.yaml").read_text())["data"]["init_args"]["train"]
    assert recorded == {"class_path": "my_data.make_dataset", "init_args": {"n": 200}}


@pytest.mark.claim("any-dataset-factory")
@pytest.mark.parametrize("init_args", [{"tensors": [[1.0, 2.0], [0, 1]]}, [[1.0, 2.0], [0, 1]]])
def test_tensor_dataset_positional_arguments_name_the_factory(in_tmp, capsys, init_args):
    train = {"class_path": "torch.utils.data.TensorDataset", "init_args": init_args}
    assert fit(write_config(in_tmp / "tensors.yaml", train, num_classes=2)) == 2
    lines = error_lines(capsys)
    assert len(lines) == 3, lines  # the paragraph, then the 2-line example
    assert "torch.utils.data.TensorDataset takes its arguments by position (*tensors)" in lines[0], lines
    assert lines[1].strip() == f"my_data.py:  {FACTORY}"
    assert lines[2].strip() == "the config:  train: {class_path: my_data.make_dataset, init_args: {n: 100}}"
    # The flag form names the flag.
    flags = [
        "--data.init_args.train",
        "torch.utils.data.TensorDataset",
        "--data.init_args.train.init_args.tensors",
    ]
    assert fit(write_config(in_tmp / "rows.yaml", FAKE), *flags, "[1]") == 2
    assert error_paragraph(capsys).startswith(
        "--data.init_args.train.init_args.tensors: torch.utils.data.Tensor"
    )

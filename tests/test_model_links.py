"""README "Fill in your model": any class or builder function is the model, and the data's num_classes and
in_channels reach only the arguments it takes, never over a value the user gave (project/links.py). Models and data
come from torchvision (builders, classes, FakeData through the any-Dataset path) or from a file the test writes; an
error raised in the user's own code keeps its traceback under one line naming where, and leaves no run directory.
"""

import sys
import textwrap
from pathlib import Path

import pytest

from project.checkpoint import read_checkpoint
from tests.conftest import CONFIGS, read_summary, run_cli

SHORT = [
    "--trainer.max_epochs", "1",
    "--trainer.limit_train_batches", "2",
    "--trainer.limit_val_batches", "1",
    "--trainer.limit_test_batches", "1",
]  # fmt: skip
FAKE_DATA = """
data:
  class_path: project.data.DatasetDataModule
  init_args:
    train:
      class_path: torchvision.datasets.FakeData
      init_args:
        size: 96
        image_size: [3, 32, 32]
        num_classes: 4
        transform: {class_path: torchvision.transforms.ToTensor}
    batch_size: 8
"""


@pytest.fixture
def user_dir(in_tmp, monkeypatch) -> Path:
    """The working directory, importable as the user's own code (my_models.py, fake.yaml)."""
    monkeypatch.syspath_prepend(str(in_tmp))
    (in_tmp / "fake.yaml").write_text(FAKE_DATA)
    yield in_tmp
    for name in [m for m in sys.modules if m.startswith("my_")]:
        del sys.modules[name]


def fit(*args: str) -> int:
    return run_cli("fit", "--config", CONFIGS / "default.yaml", "--config", "fake.yaml", *SHORT, *args)


@pytest.mark.slow
@pytest.mark.claim("own-model-builder-functions")
@pytest.mark.parametrize(
    "model",
    ["torchvision.models.resnet18", "torchvision.models.squeezenet1_1", "torchvision.models.SqueezeNet"],
)
def test_a_torchvision_builder_or_class_is_the_model(user_dir, model):
    assert fit("--model.init_args.model", model, "--run_dir", "run") == 0
    summary = read_summary(user_dir / "run")
    assert 0.0 <= summary["test_acc"] <= 1.0, summary
    checkpoint = read_checkpoint(summary["last_checkpoint"])
    nested = checkpoint["hyper_parameters"]["model"]
    assert (nested["class_path"], nested["init_args"]["num_classes"]) == (model, 4)  # linked from FakeData
    assert checkpoint["state_dict"][head_key(checkpoint["state_dict"])].shape[0] == 4


def head_key(state: dict) -> str:
    """The last weight of the network: its classification head."""
    return [k for k in state if k.startswith("model.") and k.endswith("weight")][-1]


@pytest.mark.claim("own-model-linked-args")
def test_a_value_the_user_gave_is_never_overwritten_by_a_link(user_dir):
    # FakeData does not say its channel count: the link wrote None over ConvNet's in_channels, the flag included.
    assert fit("--model.init_args.model.init_args.in_channels", "3", "--run_dir", "run") == 0
    nested = read_checkpoint(read_summary(user_dir / "run")["last_checkpoint"])["hyper_parameters"]["model"]
    assert nested["init_args"]["in_channels"] == 3
    assert "test_acc" in read_summary(user_dir / "run")


def test_a_required_argument_the_data_cannot_fill_names_its_flag(user_dir, capsys):
    (user_dir / "my_rows.py").write_text(
        textwrap.dedent("""
        import torch
        from torch import nn

        class Rows(torch.utils.data.Dataset):  # tabular rows: no image, no channel count
            num_classes = 3
            def __len__(self):
                return 120
            def __getitem__(self, i):
                return torch.full((6,), float(i % 3)), i % 3

        class RowNet(nn.Module):
            def __init__(self, num_classes: int, in_channels: int):
                super().__init__()
                self.fc = nn.Linear(in_channels, num_classes)
            def forward(self, x):
                return self.fc(x)
        """)
    )
    code = run_cli(
        "fit", "--config", CONFIGS / "default.yaml", *SHORT,
        "--data", "project.data.DatasetDataModule", "--data.init_args.train", "my_rows.Rows",
        "--model.init_args.model", "my_rows.RowNet", "--model.init_args.channels_last", "false",
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2, err
    assert "--model.init_args.model.init_args.in_channels" in err and "Traceback" not in err, err
    assert not (user_dir / "runs").exists() or not any((user_dir / "runs").iterdir())


def test_an_error_in_the_users_forward_keeps_its_traceback_under_one_line(user_dir, capsys):
    (user_dir / "my_models.py").write_text(
        textwrap.dedent("""
        from torch import nn

        class Broken(nn.Module):
            def __init__(self, num_classes: int):
                super().__init__()
                self.fc = nn.LazyLinear(num_classes)
            def forward(self, x):
                if self.training:
                    raise RuntimeError("a bug in my forward")
                return self.fc(x.flatten(1))
        """)
    )
    code = run_cli(
        "fit", "--config", CONFIGS / "default.yaml", *SHORT, "--model.init_args.model", "my_models.Broken"
    )
    err = capsys.readouterr().err
    assert code == 1, err
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert line.startswith(f"error: raised in your code, {user_dir / 'my_models.py'}:10 in forward"), line
    assert err.rstrip().endswith("RuntimeError: a bug in my forward") and "Traceback" in err, err
    # It failed before its first checkpoint: no run for `make tensorboard` to list or `make resume` to pick.
    assert not any((user_dir / "runs").iterdir()), list((user_dir / "runs").iterdir())


def test_the_data_to_model_links_keep_what_the_user_gave(tmp_path):
    from jsonargparse import Namespace

    from project.links import given_keys, plan

    nested = Namespace(
        class_path="project.models.ConvNet",
        init_args=Namespace(num_classes=None, in_channels=3, width=32, dropout=0.1),
    )
    config = Namespace(model=Namespace(init_args=Namespace(model=nested)))
    both = ["model.init_args.model.init_args.num_classes", "model.init_args.model.init_args.in_channels"]
    # in_channels=3 that nobody typed: a class path change keeps the old class's value, which is no user's
    assert [link.target for link in plan(config, given_keys(["fit"]))] == both
    typed = given_keys(["fit", "--model.init_args.model.init_args.in_channels=3"])
    assert [link.target for link in plan(config, typed)] == both[:1]
    (tmp_path / "mine.yaml").write_text(
        "model:\n  init_args:\n    model:\n      init_args: {in_channels: 3}\n"
    )
    in_yaml = given_keys(["fit", "--config", str(tmp_path / "mine.yaml")])
    assert [link.target for link in plan(config, in_yaml)] == both[:1]

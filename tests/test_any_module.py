"""Any LightningModule by `model.class_path`, shown by configs/autoencoder.yaml (another task: denoising).

The README command as a process (`make train CONFIG=configs/autoencoder.yaml`, 3 of its 15 epochs) in a fresh
checkout; the checkpoint it selects is then loaded back by the class alone, and the data-to-model links are checked
to reach only the arguments each class takes.
"""

from pathlib import Path

import pytest
import torch
import yaml

from project.autoencoder import DenoisingAutoencoder
from project.links import DATA_TO_MODEL, plan
from tests.conftest import CONFIGS, read_summary

TRAIN = "make train CONFIG=configs/autoencoder.yaml"
EPOCHS = 3
# The data module standardises each channel to mean 0 and variance 1 over the training split, so predicting any
# constant image scores a mean squared error of about 1 on the test split; half of that is a model that learned
# the digits' shapes, which 3 epochs reach with room to spare (0.35 on seed 0).
LEARNED_MSE = 0.5


@pytest.fixture(scope="module")
def autoencoder_run(tmp_path_factory) -> Path:
    from tests.test_readme import readme_train_run

    return readme_train_run(tmp_path_factory, "autoencoder", TRAIN, EPOCHS)


@pytest.mark.slow
@pytest.mark.claim("any-lightning-module")
def test_another_task_trains_tests_and_reloads(autoencoder_run):
    run = autoencoder_run
    summary = read_summary(run)
    assert (summary["epochs"], summary["monitor"]) == (EPOCHS, "val/loss"), summary
    assert summary["test_loss"] < LEARNED_MSE, summary
    assert "test_acc" not in summary and (run / "report.png").stat().st_size > 5_000
    config = yaml.safe_load((run / "config.yaml").read_text())["model"]
    assert config["class_path"] == "project.autoencoder.DenoisingAutoencoder"
    assert "input_shape" not in config["init_args"]  # linked from the data, never typed
    # The selected checkpoint loads by the class alone: its hyperparameters are the class's own arguments (no
    # classifier's num_classes or nested model slipped in through the data-to-model links).
    best = summary["best_checkpoint"]
    module = DenoisingAutoencoder.load_from_checkpoint(best, map_location="cpu", weights_only=False)
    assert set(module.hparams) <= {"input_shape", "code_size", "noise_std", "_instantiator", "_class_path"}
    assert tuple(module.hparams.input_shape) == (1, 8, 8)
    assert module(torch.zeros(2, 1, 8, 8)).shape == (2, 1, 8, 8)


def test_links_reach_only_the_arguments_each_class_takes():
    from jsonargparse import Namespace

    def targets(model) -> list[str]:
        return [link.target for link in plan(Namespace(model=model))]

    classifier = yaml.safe_load((CONFIGS / "default.yaml").read_text())["model"]
    assert targets(classifier_namespace(classifier)) == [target for _, target in DATA_TO_MODEL]
    autoencoder = Namespace(
        class_path="project.autoencoder.DenoisingAutoencoder",
        init_args=Namespace(input_shape=None, code_size=16, noise_std=0.3),
    )
    assert targets(autoencoder) == ["model.init_args.input_shape"]


def classifier_namespace(model: dict) -> dict:
    """configs/default.yaml's model section as the parser gives it: nested class_path/init_args as Namespaces."""
    from jsonargparse import Namespace

    nested = Namespace(
        class_path=model["init_args"]["model"]["class_path"], init_args=Namespace(num_classes=None)
    )
    nested.init_args.in_channels = 1  # the parser fills in the defaults
    init = dict(model["init_args"], model=nested, num_classes=None, input_shape=None)
    return Namespace(class_path=model["class_path"], init_args=Namespace(**init))

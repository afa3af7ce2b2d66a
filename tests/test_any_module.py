"""Any LightningModule by `model.class_path`, shown by one that Lightning ships (README "Fill in your model").

The README command (`make train ARGS="--model ... --data ..."`, 3 epochs) in a fresh checkout, in-process: it
trains, tests, writes a checkpoint and a summary; the checkpoint loads back by the class alone, and the
data-to-model links are checked to reach only the arguments each class takes.
"""

from pathlib import Path

import pytest
import torch
import yaml

from project.links import DATA_TO_MODEL, plan
from tests.conftest import CONFIGS, read_summary

DEMOS = "lightning.pytorch.demos"
TRAIN = f'make train ARGS="--model {DEMOS}.BoringModel --data {DEMOS}.BoringDataModule"'
EPOCHS = 3


@pytest.fixture(scope="module")
def boring_run(tmp_path_factory) -> Path:
    from tests.test_readme import readme_train_run

    return readme_train_run(tmp_path_factory, "boring", TRAIN, EPOCHS)


@pytest.mark.slow
@pytest.mark.claim("any-lightning-module")
def test_a_module_lightning_ships_trains_tests_and_reloads(boring_run):
    from lightning.pytorch.demos import BoringModel

    run = boring_run
    summary = read_summary(run)
    assert (summary["epochs"], summary["monitor"]) == (EPOCHS, None), summary  # it logs no val/loss
    assert summary["last_checkpoint"].endswith("last.ckpt") and (run / "report.png").stat().st_size > 5_000
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["model"]["class_path"] == f"{DEMOS}.BoringModel"
    assert config["data"]["class_path"] == f"{DEMOS}.BoringDataModule"
    # The checkpoint loads by the class alone: no classifier's argument slipped in through the data-to-model links.
    module = BoringModel.load_from_checkpoint(
        summary["last_checkpoint"], map_location="cpu", weights_only=False
    )
    assert set(module.hparams) <= {"_instantiator", "_class_path"}
    assert module(torch.zeros(2, 32)).shape == (2, 2)


def test_links_reach_only_the_arguments_each_class_takes():
    from jsonargparse import Namespace

    def targets(model) -> list[str]:
        return [link.target for link in plan(Namespace(model=model))]

    classifier = yaml.safe_load((CONFIGS / "default.yaml").read_text())["model"]
    assert targets(classifier_namespace(classifier)) == [target for _, target in DATA_TO_MODEL]
    assert targets(Namespace(class_path=f"{DEMOS}.BoringModel", init_args=Namespace())) == []


def classifier_namespace(model: dict) -> dict:
    """configs/default.yaml's model section as the parser gives it: nested class_path/init_args as Namespaces."""
    from jsonargparse import Namespace

    nested = Namespace(
        class_path=model["init_args"]["model"]["class_path"], init_args=Namespace(num_classes=None)
    )
    nested.init_args.in_channels = 1  # the parser fills in the defaults
    init = dict(model["init_args"], model=nested, num_classes=None, input_shape=None)
    return Namespace(class_path=model["class_path"], init_args=Namespace(**init))

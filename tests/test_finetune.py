"""Transfer learning: frozen backbone (BatchNorm statistics included) untouched, head trained, per-part LRs."""

import pytest
import torch
import torchvision
from lightning import Callback, Trainer

from project.data import ImageClassificationDataModule
from project.errors import ConfigError
from project.finetune import FinetuneModule
from project.models import TorchvisionClassifier
from tests.conftest import CONFIGS, QUIET, run_cli

NAME = "shufflenet_v2_x0_5"  # 1.4 M parameters, with BatchNorm and an `fc` head


@pytest.fixture(scope="module")
def weights_file(tmp_path_factory):
    """Random "pretrained" weights in a local file, as on an offline machine."""
    path = tmp_path_factory.mktemp("weights") / f"{NAME}.pth"
    torch.manual_seed(0)
    torch.save(torchvision.models.get_model(NAME, num_classes=1000).state_dict(), path)
    return path


class Snapshot(Callback):
    """The model's state at the end of each training epoch."""

    def __init__(self):
        self.states = []

    def on_train_epoch_end(self, trainer, pl_module):
        self.states.append({k: v.clone() for k, v in pl_module.model.state_dict().items()})


def test_frozen_backbone_unchanged_head_trained_then_unfrozen(weights_file, tmp_path):
    data = ImageClassificationDataModule(batch_size=16)
    model = TorchvisionClassifier(NAME, num_classes=10, weights=str(weights_file), in_channels=1)
    module = FinetuneModule(
        model, num_classes=10, input_shape=(1, 8, 8), lr=0.01, backbone_lr=0.001, unfreeze_epoch=1
    )
    before = {k: v.clone() for k, v in module.model.state_dict().items()}
    snap = Snapshot()
    trainer = Trainer(
        max_epochs=2,
        limit_train_batches=3,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[snap],
        default_root_dir=tmp_path,
    )
    trainer.fit(module, datamodule=data)
    pretrained = torch.load(weights_file, weights_only=True)
    frozen, unfrozen = snap.states
    for key, value in frozen.items():  # epoch 0: backbone frozen
        if key.startswith("net.fc."):
            assert not torch.equal(value, before[key]), f"head {key} did not train"
        else:  # weights and BatchNorm running statistics alike
            assert torch.equal(value, before[key]), f"frozen {key} changed"
            if not key.endswith("num_batches_tracked"):
                assert torch.equal(value, pretrained[key.removeprefix("net.")]), key
    stem = next(iter(pretrained))
    assert not torch.equal(unfrozen[f"net.{stem}"], frozen[f"net.{stem}"])  # epoch 1: the backbone trains
    bn_mean = next(k for k in frozen if k.endswith("running_mean"))
    assert not torch.equal(unfrozen[bn_mean], frozen[bn_mean])  # ...and BatchNorm statistics update again
    lrs = {g["initial_lr"] for g in trainer.optimizers[0].param_groups}
    assert lrs == {0.001, 0.01}  # backbone groups at backbone_lr, head groups at lr


def test_finetune_config(weights_file, in_tmp):
    args = [
        "--config",
        CONFIGS / "finetune.yaml",
        "--model.init_args.model.init_args.name",
        NAME,
        "--model.init_args.model.init_args.weights",
        weights_file,
        "--trainer.max_epochs",
        "1",
        "--trainer.limit_train_batches",
        "2",
        "--trainer.limit_val_batches",
        "1",
        "--trainer.num_sanity_val_steps",
        "0",
        "--data.init_args.batch_size",
        "16",
        "--test_after_fit",
        "false",
        "--run_dir",
        in_tmp / "run",
        *QUIET,
    ]
    assert run_cli("fit", *args) == 0
    ckpt = torch.load(in_tmp / "run/checkpoints/last.ckpt", weights_only=True)
    pretrained = torch.load(weights_file, weights_only=True)
    stem = next(iter(pretrained))
    assert torch.equal(
        ckpt["state_dict"][f"model.net.{stem}"], pretrained[stem]
    )  # frozen for the first epochs
    hp = ckpt["hyper_parameters"]
    assert (
        hp["_class_path"] == "project.finetune.FinetuneModule"
        and hp["freeze_backbone"]
        and hp["unfreeze_epoch"] == 3
    )


def test_missing_pretrained_weights_say_where_to_put_them(monkeypatch, tmp_path):
    from urllib.error import URLError

    monkeypatch.setenv("TORCH_HOME", str(tmp_path))  # an empty cache

    def offline(*args, **kwargs):
        raise URLError("no network")

    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", offline)
    with pytest.raises(
        ConfigError, match=rf"put it at {tmp_path}/hub/checkpoints/shufflenetv2_x0.5-\w+\.pth"
    ):
        TorchvisionClassifier(NAME, num_classes=10, weights="DEFAULT")

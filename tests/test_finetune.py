"""Transfer learning: frozen backbone (BatchNorm statistics included) untouched, head trained, per-part LRs."""

import pytest
import torch
import torchvision
from lightning import Trainer

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


def test_frozen_backbone_unchanged_head_trained(weights_file, tmp_path):
    data = ImageClassificationDataModule(batch_size=32)
    model = TorchvisionClassifier(NAME, num_classes=10, weights=str(weights_file), in_channels=1)
    module = FinetuneModule(model, num_classes=10, input_shape=(1, 8, 8), lr=0.01, backbone_lr=0.001)
    before = {k: v.clone() for k, v in module.model.state_dict().items()}
    trainer = Trainer(max_epochs=1, limit_train_batches=3, limit_val_batches=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(module, datamodule=data)
    after = module.model.state_dict()
    pretrained = torch.load(weights_file, weights_only=True)
    for key, value in after.items():
        if key.startswith("net.fc."):
            assert not torch.equal(value, before[key]), f"head {key} did not train"
        else:  # weights and BatchNorm running statistics alike
            assert torch.equal(value, before[key]), f"frozen {key} changed"
            if not key.endswith("num_batches_tracked"):
                assert torch.equal(value, pretrained[key.removeprefix("net.")]), key
    lrs = {len(g["params"]): g["initial_lr"] for g in trainer.optimizers[0].param_groups}
    assert sorted(set(lrs.values())) == [0.001, 0.01]  # backbone groups at backbone_lr, head groups at lr


def test_finetune_config_unfreezes(weights_file, in_tmp):
    args = ["--config", CONFIGS / "finetune.yaml", "--model.init_args.model.init_args.name", NAME,
            "--model.init_args.model.init_args.weights", weights_file,
            "--model.init_args.unfreeze_epoch", "1", "--trainer.max_epochs", "2", "--trainer.limit_train_batches", "2",
            "--trainer.limit_val_batches", "1", "--test_after_fit", "false", "--run_dir", in_tmp / "run", *QUIET]
    assert run_cli("fit", *args) == 0
    state = torch.load(in_tmp / "run/checkpoints/last.ckpt", weights_only=True)
    pretrained = torch.load(weights_file, weights_only=True)
    first = next(iter(pretrained))  # the stem convolution: backbone
    assert not torch.equal(state["state_dict"][f"model.net.{first}"], pretrained[first])  # trained after unfreezing
    assert state["hyper_parameters"]["unfreeze_epoch"] == 1


def test_missing_pretrained_weights_say_where_to_put_them(monkeypatch, tmp_path):
    from urllib.error import URLError

    monkeypatch.setenv("TORCH_HOME", str(tmp_path))  # an empty cache

    def offline(*args, **kwargs):
        raise URLError("no network")

    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", offline)
    with pytest.raises(ConfigError, match=rf"put it at {tmp_path}/hub/checkpoints/shufflenetv2_x0.5-\w+\.pth"):
        TorchvisionClassifier(NAME, num_classes=10, weights="DEFAULT")

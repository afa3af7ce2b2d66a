import lightning as L
import pytest
import torch
from torch import nn

from project.errors import ConfigError
from project.models import ConvNet
from project.module import ClassificationModule


def make_module(**kwargs) -> ClassificationModule:
    return ClassificationModule(
        ConvNet(num_classes=10, in_channels=1, width=8), num_classes=10, input_shape=(1, 8, 8), **kwargs
    )


def test_head_size_mismatch_is_a_clear_error_before_training():
    with pytest.raises(ConfigError, match=r"returns outputs of shape \(2, 5\).*10 classes.*num_classes"):
        ClassificationModule(ConvNet(num_classes=5, in_channels=1), num_classes=10, input_shape=(1, 8, 8))


def test_wrong_input_channels_is_a_clear_error():
    with pytest.raises(ConfigError, match="in_channels"):
        ClassificationModule(ConvNet(num_classes=10, in_channels=3), num_classes=10, input_shape=(1, 8, 8))


@pytest.mark.claim("adamw-fused-no-decay-on-bias-norm")
def test_no_weight_decay_on_biases_and_norm_parameters():
    module = make_module(weight_decay=0.1)
    module.trainer = L.Trainer(max_epochs=1, logger=False, enable_checkpointing=False)
    optimizer = module.configure_optimizers()["optimizer"]
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim > 1 for p in decay["params"]) and all(p.ndim == 1 for p in no_decay["params"])
    n_bn = sum(1 for m in module.model.modules() if isinstance(m, nn.BatchNorm2d))
    assert len(no_decay["params"]) == 2 * n_bn + 1  # BN weight+bias per norm, plus the head's bias


@pytest.mark.claim("metrics-float32-logits")
def test_metrics_are_float32_under_bf16_autocast():
    module = make_module()
    x, y = torch.randn(4, 1, 8, 8), torch.randint(0, 10, (4,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, logits, _ = module._shared_step((x, y))
    assert logits.dtype == torch.float32 and loss.dtype == torch.float32


def test_hyperparameters_do_not_pickle_the_model_outside_the_cli():
    module = make_module(lr=0.01)
    assert "model" not in module.hparams and module.hparams.lr == 0.01


def test_top5_only_with_more_than_five_classes():
    assert make_module().top5
    small = ClassificationModule(
        ConvNet(num_classes=3, in_channels=1, width=8), num_classes=3, input_shape=(1, 8, 8)
    )
    assert not small.top5


@pytest.mark.claim("lr-warmup-cosine-per-step")
def test_learning_rate_follows_warmup_then_cosine(tmp_path):
    """Train a few steps on random data and read back the lr the optimizer actually used per step."""
    from torch.utils.data import DataLoader, TensorDataset

    module = make_module(lr=0.01, warmup_epochs=1.0)
    seen = []

    class Record(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(trainer.optimizers[0].param_groups[0]["lr"])

    data = DataLoader(TensorDataset(torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,))), batch_size=8)
    trainer = L.Trainer(
        max_epochs=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Record()],
        default_root_dir=tmp_path,
    )
    trainer.fit(module, data)
    # 4 steps per epoch, 12 in all, warmup = 1 epoch = 4 steps.
    assert seen[:4] == pytest.approx([0.0025, 0.005, 0.0075, 0.01])
    assert seen[4] == pytest.approx(0.01) and seen[-1] < 0.001
    assert all(a >= b for a, b in zip(seen[4:], seen[5:]))


@pytest.mark.claim("adamw-fused-no-decay-on-bias-norm")
def test_adamw_uses_the_fused_kernel_where_torch_has_one():
    from project.module import fused_supported

    module = ClassificationModule(ConvNet(10, width=4), 10, (1, 8, 8))
    optimizer = module.configure_optimizers()["optimizer"]
    assert optimizer.defaults["fused"] is True  # CPU float32 parameters: fused AdamW exists since torch 2.4
    assert not fused_supported([{"params": [torch.nn.Parameter(torch.zeros(2, device="meta"))]}])
    assert not fused_supported([{"params": []}])

import math
from functools import partial
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from project.data import ImageClassificationDataModule
from project.errors import ConfigError
from project.models import ConvNet
from project.module import ClassificationModule
from project.optim import WarmupCosine
from tests.conftest import CONFIGS, QUIET, run_cli


def adamw(**kwargs):
    """What LightningCLI passes for `optimizer: {class_path: torch.optim.AdamW, init_args: kwargs}`."""
    return partial(torch.optim.AdamW, **kwargs)


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
    module = make_module(optimizer=adamw(lr=0.003, weight_decay=0.1))
    module.trainer = L.Trainer(max_epochs=1, logger=False, enable_checkpointing=False)
    optimizer = module.configure_optimizers()["optimizer"]
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim > 1 for p in decay["params"]) and all(p.ndim == 1 for p in no_decay["params"])
    n_bn = sum(1 for m in module.model.modules() if isinstance(m, nn.BatchNorm2d))
    assert len(no_decay["params"]) == 2 * n_bn + 1  # BN weight+bias per norm, plus the head's bias
    # Named groups: LearningRateMonitor logs lr-AdamW/decay and lr-AdamW/no_decay.
    assert [g["name"] for g in optimizer.param_groups] == ["decay", "no_decay"]


@pytest.mark.claim("metrics-float32-logits")
def test_metrics_are_float32_under_bf16_autocast():
    module = make_module()
    x, y = torch.randn(4, 1, 8, 8), torch.randint(0, 10, (4,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, logits, _ = module._shared_step((x, y))
    assert logits.dtype == torch.float32 and loss.dtype == torch.float32


def test_hyperparameters_do_not_pickle_the_model_outside_the_cli():
    module = make_module(optimizer=adamw(lr=0.01), label_smoothing=0.1)
    assert "model" not in module.hparams and module.hparams.label_smoothing == 0.1
    # The optimizer and scheduler are callables outside the CLI: not pickled into checkpoints either.
    assert "optimizer" not in module.hparams and "scheduler" not in module.hparams


def test_top5_only_with_more_than_five_classes():
    assert list(make_module().test_metrics.keys()) == ["test/acc", "test/acc_top5"]
    small = ClassificationModule(
        ConvNet(num_classes=3, in_channels=1, width=8), num_classes=3, input_shape=(1, 8, 8)
    )
    assert list(small.val_metrics.keys()) == ["val/acc"]


@pytest.mark.claim("lr-warmup-cosine-per-step")
def test_learning_rate_follows_warmup_then_cosine(tmp_path):
    """Train a few steps on random data and read back the lr the optimizer actually used per step."""
    module = make_module(optimizer=adamw(lr=0.01), scheduler=partial(WarmupCosine, warmup_epochs=1.0))
    seen = []

    class Record(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append([g["lr"] for g in trainer.optimizers[0].param_groups])

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
    assert all(decay == no_decay for decay, no_decay in seen)  # one schedule for both groups
    seen = [decay for decay, _ in seen]
    # 4 steps per epoch, 12 in all, warmup = 1 epoch = 4 steps.
    assert seen[:4] == pytest.approx([0.0025, 0.005, 0.0075, 0.01])
    assert seen[4] == pytest.approx(0.01) and seen[-1] < 0.001
    assert all(a >= b for a, b in zip(seen[4:], seen[5:]))
    # The cosine at known steps: step 4 + k of the 8 decay steps is at 0.01 * (1 + cos(pi k / 8)) / 2.
    cosine = [0.01 * 0.5 * (1 + math.cos(math.pi * k / 8)) for k in range(8)]
    assert seen[4:] == pytest.approx(cosine, rel=1e-12)  # same formula, float64: rounding only


@pytest.mark.claim("adamw-fused-no-decay-on-bias-norm")
def test_adamw_uses_the_fused_kernel_where_torch_has_one():
    module = ClassificationModule(ConvNet(10, width=4), 10, (1, 8, 8))
    optimizer = module.configure_optimizers()["optimizer"]
    assert optimizer.defaults["fused"] is True  # CPU float32 parameters: fused AdamW exists since torch 2.4
    on_meta = ClassificationModule(ConvNet(10, width=4), 10).to("meta")  # a device without the fused kernel
    assert on_meta.configure_optimizers()["optimizer"].defaults["fused"] is None
    # As configured: the same arguments, fused kernel on (LightningCLI passes fused=None when unset).
    configured = ClassificationModule(
        ConvNet(10, width=4), 10, (1, 8, 8), optimizer=adamw(lr=0.02, betas=(0.8, 0.9), fused=None)
    ).configure_optimizers()["optimizer"]
    assert configured.defaults["fused"] is True
    assert configured.defaults["lr"] == 0.02 and configured.defaults["betas"] == (0.8, 0.9)
    # fused: false is kept (plain Adam, torch's loop), and optimizers without a fused kernel are left alone.
    adam = partial(torch.optim.Adam, lr=0.01, fused=False)
    plain = ClassificationModule(ConvNet(10, width=4), 10, (1, 8, 8), optimizer=adam)
    assert plain.configure_optimizers()["optimizer"].defaults["fused"] is False


@pytest.mark.claim("clip-under-amp")
def test_gradient_clipping_under_mixed_precision_trains(tmp_path):
    """bf16-mixed (the GPU default) + gradient_clip_val: Lightning refuses to clip for a fused AdamW, so such a run
    gets torch's default AdamW and trains; without clipping the fused kernel stays. bf16 autocast runs on CPU too."""
    data = DataLoader(TensorDataset(torch.randn(16, 1, 8, 8), torch.randint(0, 10, (16,))), batch_size=8)
    for clip, fused in ((1.0, None), (None, True)):
        module = make_module()
        trainer = L.Trainer(
            max_epochs=1,
            precision="bf16-mixed",
            gradient_clip_val=clip,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
        )
        trainer.fit(module, data)  # fused + clipping raised "does not allow for gradient clipping" here
        assert trainer.global_step == 2
        assert trainer.optimizers[0].defaults["fused"] is fused


@pytest.mark.claim("ddp-lr-scaling")
def test_lr_scaling_linear_scales_every_group_of_any_optimizer():
    """lr_scaling: linear multiplies each group's lr (the schedule's peak, initial_lr) by the world size."""
    for optimizer, lr in ((adamw(lr=0.003), 0.003), (partial(torch.optim.SGD, lr=0.1, momentum=0.9), 0.1)):
        module = make_module(optimizer=optimizer, lr_scaling="linear")
        module._trainer = SimpleNamespace(world_size=4)  # configure_optimizers reads only the world size
        assert module.scaled_lr(4) == lr * 4  # what the CLI prints for DDP: the same product, exact
        config = module.configure_optimizers()
        groups = config["optimizer"].param_groups
        assert [g["initial_lr"] for g in groups] == [lr * 4, lr * 4]  # the same product: exact
        assert isinstance(config["lr_scheduler"]["scheduler"], WarmupCosine)
        assert config["lr_scheduler"]["interval"] == "step"
    module = make_module(optimizer=adamw(lr=0.003))  # lr_scaling none: as configured on any world size
    module._trainer = SimpleNamespace(world_size=4)
    assert [g["initial_lr"] for g in module.configure_optimizers()["optimizer"].param_groups] == [
        0.003,
        0.003,
    ]
    assert module.scaled_lr(4) == 0.003


@pytest.mark.slow
@pytest.mark.claim("optimizer-scheduler-config")
def test_sgd_and_reduce_on_plateau_by_config_train(in_tmp):
    """Another optimizer and scheduler from the command line only: the run trains with them."""
    args = [
        "--config", CONFIGS / "default.yaml",
        "--model.init_args.optimizer", "torch.optim.SGD",
        "--model.init_args.optimizer.init_args.lr", "0.05",
        "--model.init_args.optimizer.init_args.momentum", "0.9",
        "--model.init_args.scheduler", "torch.optim.lr_scheduler.ReduceLROnPlateau",
        "--model.init_args.scheduler.init_args.patience", "0",
        "--trainer.max_epochs", "2",
        "--trainer.limit_train_batches", "3",
        "--trainer.limit_val_batches", "1",
        "--test_after_fit", "false",
        "--run_dir", in_tmp / "run",
        *QUIET,
    ]  # fmt: skip
    assert run_cli("fit", *args) == 0
    ckpt = torch.load(in_tmp / "run/checkpoints/last.ckpt", weights_only=True)
    hp = ckpt["hyper_parameters"]
    assert hp["optimizer"]["class_path"] == "torch.optim.SGD" and hp["optimizer"]["init_args"]["lr"] == 0.05
    (state,) = ckpt["optimizer_states"]
    assert [g["name"] for g in state["param_groups"]] == ["decay", "no_decay"]
    # 0.05, or once reduced by the plateau's default factor 0.1 (the same product: exact)
    assert all(g["momentum"] == 0.9 and g["lr"] in (0.05, 0.05 * 0.1) for g in state["param_groups"])
    assert all("momentum_buffer" in s for s in state["state"].values())  # SGD's own state: it stepped
    assert ckpt["global_step"] == 6  # 2 epochs x 3 batches
    (scheduler,) = ckpt["lr_schedulers"]
    assert "num_bad_epochs" in scheduler and scheduler["best"] < float("inf")  # stepped on val/loss


@pytest.mark.claim("labels-checked-contract")
def test_torchmetrics_checks_stay_on_unless_the_data_module_checked_the_labels():
    """validate_args is off only under a data module that declares `labels_checked` (ours checks each label)."""
    preds, wrong_shape = torch.randn(4, 10), torch.zeros(4, 3, dtype=torch.long)

    def metrics_after_setup(datamodule) -> list:
        module = make_module()
        module._trainer = SimpleNamespace(datamodule=datamodule)
        module.setup("fit")
        # (training accuracy is counted on the device, not by torchmetrics: CrossEntropy checks those shapes)
        return [*module.val_metrics.values(), *module.test_metrics.values()]

    class UsersDataModule(L.LightningDataModule):  # a data module of the user's own, no promise made
        pass

    for metric in metrics_after_setup(UsersDataModule()):
        assert metric.validate_args
        with pytest.raises(ValueError, match="should have the same shape"):
            metric.update(preds, wrong_shape)
    assert ImageClassificationDataModule.labels_checked is True
    assert not any(m.validate_args for m in metrics_after_setup(ImageClassificationDataModule()))
    assert all(m.validate_args for m in metrics_after_setup(None))  # trainer.fit(module, loaders): checks on


def test_test_step_returns_float32_logits_for_callbacks():
    """RunReport reads test_step's return value as each test batch's logits (on_test_batch_end's `outputs`)."""
    module = make_module()
    x, y = torch.randn(4, 1, 8, 8), torch.randint(0, 10, (4,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = module.test_step((x, y), 0)
    assert logits.shape == (4, 10) and logits.dtype == torch.float32
    module.eval()
    assert torch.equal(module.test_step((x, y), 0), module(x).float())

"""PitfallGuards: each faulty model gets one warning naming the culprit; a correct model gets none.
NonFiniteLossGuard: a NaN loss never changes the weights, with the fused kernel's skip flag or the host fallback.

Each PitfallGuards test fails when its guard is removed: it unpacks exactly one PitfallWarning (no warning, or one
per module the bad tensor passes through, both fail).
"""

import warnings

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from project.callbacks import NonFiniteLossGuard, PitfallGuards
from project.callbacks.nonfinite_loss import NonFiniteLossError
from project.callbacks.pitfall_guards import PitfallWarning
from project.models import ConvNet
from project.module import ClassificationModule


def fit_two_steps(
    module: L.LightningModule, dtype=torch.float32, expect_error: bool = False, datamodule=None
) -> list[str]:
    data = TensorDataset(torch.rand(8, 1, 8, 8, dtype=dtype), torch.randint(0, 10, (8,)))
    trainer = L.Trainer(
        max_steps=2,
        callbacks=[PitfallGuards()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if datamodule is not None:
                trainer.fit(module, datamodule=datamodule)
            else:
                trainer.fit(module, DataLoader(data, batch_size=4))
        except RuntimeError:  # the wrong-device case: the op itself then fails on this CPU-only machine
            if not expect_error:
                raise
        else:
            assert not expect_error, "the faulty model was expected to fail after the warning"
    return [str(w.message) for w in caught if issubclass(w.category, PitfallWarning)]


def module_with(model: nn.Module) -> ClassificationModule:
    return ClassificationModule(model, num_classes=10)


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        return self.fc(x.flatten(1))


class SoftmaxHead(Head):
    def forward(self, x):
        return super().forward(x).softmax(-1)


class PlainList(Head):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = [nn.Linear(64, 64)]  # the bug: not an nn.ModuleList

    def forward(self, x):
        return self.fc(self.blocks[0](x.flatten(1)))


class UnusedBranch(Head):
    def __init__(self) -> None:
        super().__init__()
        self.aux = nn.Linear(64, 10)


class WrongDevice(Head):
    def forward(self, x):
        return self.fc(x.flatten(1).to("meta"))


class FrozenInOptimizer(ClassificationModule):
    def configure_optimizers(self):  # the bug: the head's bias is left out of the optimizer
        return torch.optim.SGD([self.model.fc.weight], lr=0.1)


@pytest.mark.claim("guards-correct-model-silent")
def test_correct_model_gives_no_warning():
    # The default model as configs/default.yaml builds it (ConvNet width 32 with dropout, channels_last, label
    # smoothing 0.1) on the default data module's real digits batches.
    from project.data import ImageClassificationDataModule

    module = ClassificationModule(
        ConvNet(num_classes=10, in_channels=1, width=32),
        num_classes=10,
        input_shape=(1, 8, 8),
        label_smoothing=0.1,
        channels_last=True,
    )
    assert fit_two_steps(module, datamodule=ImageClassificationDataModule()) == []
    assert fit_two_steps(module_with(Head())) == []  # the plain head the faulty models below build on


@pytest.mark.claim("guard-softmax-outputs")
def test_softmax_before_cross_entropy():
    (msg,) = fit_two_steps(module_with(SoftmaxHead()))
    assert "probabilities" in msg and "'model' (SoftmaxHead)" in msg and "logits" in msg


@pytest.mark.claim("guard-no-gradient")
def test_plain_python_list_of_layers():
    (msg,) = fit_two_steps(module_with(PlainList()))
    assert "plain Python list 'blocks'" in msg and "nn.ModuleList" in msg and "PlainList" in msg


@pytest.mark.claim("guard-no-gradient")
def test_parameters_without_gradient():
    (msg,) = fit_two_steps(module_with(UnusedBranch()))
    assert "no gradient" in msg and "model.aux.weight" in msg and "model.aux.bias" in msg


@pytest.mark.claim("guard-float64-inputs")
def test_float64_inputs():
    # One warning for the batch, naming the first module it enters (it then reaches 'model' and 'model.fc' too).
    (msg,) = fit_two_steps(module_with(Head()).double(), dtype=torch.float64)
    assert "Input 0 of 'ClassificationModule'" in msg and "float64" in msg and "float32" in msg


@pytest.mark.claim("guard-wrong-device")
def test_batch_on_another_device_than_the_module():
    # Testable without a GPU: the 'meta' device stands in for another device. The mismatched op then fails
    # (expect_error); the warning naming the module and both devices comes first.
    (msg,) = fit_two_steps(module_with(WrongDevice()), expect_error=True)
    assert "Input 0 of 'model.fc'" in msg and "on meta" in msg and "parameters are on cpu" in msg


@pytest.mark.claim("guard-params-unchanged")
def test_parameters_unchanged_by_the_optimizer():
    (msg,) = fit_two_steps(FrozenInOptimizer(Head(), num_classes=10))
    assert "did not change" in msg and "model.fc.bias" in msg and "model.fc.weight" not in msg


class NaNAt(ClassificationModule):
    """Loss NaN at one optimizer step; AdamW fused (skip flag on the device) or not (the host fallback)."""

    def __init__(self, fused: bool, nan_at: int = 2) -> None:
        super().__init__(Head(), num_classes=10)
        self.fused, self.nan_at = fused, nan_at

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.global_step == self.nan_at else loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01, fused=self.fused)


class Snapshots(L.Callback):
    """The weights after every training batch, and the batch index each hook saw last."""

    def __init__(self) -> None:
        self.after: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.after.append({k: v.detach().clone() for k, v in pl_module.state_dict().items()})


def fit_nan(fused: bool, guard: bool = True) -> tuple[L.LightningModule, Snapshots, BaseException | None]:
    data = TensorDataset(torch.rand(24, 1, 8, 8), torch.randint(0, 10, (24,)))
    snaps = Snapshots()
    trainer = L.Trainer(
        max_epochs=1,
        callbacks=[NonFiniteLossGuard()] * guard + [snaps],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    module = NaNAt(fused)
    try:
        trainer.fit(module, DataLoader(data, batch_size=4))  # 6 steps, NaN at step 2
    except NonFiniteLossError as err:
        return module, snaps, err
    return module, snaps, None


@pytest.mark.claim("nan-loss-stops-run")
@pytest.mark.parametrize("fused", [True, False], ids=["fused-skip-on-device", "host-fallback"])
def test_nan_loss_never_reaches_the_weights(fused):
    module, snaps, err = fit_nan(fused)
    # fused: skipped on the device until the check after the epoch's last batch; else stopped before step 2
    step = 6 if fused else 2
    assert err is not None and f"became NaN or inf by global step {step}, epoch 0;" in str(err)
    good = snaps.after[1]  # after step 1, the last good one
    assert all(torch.equal(v, good[k]) for k, v in module.state_dict().items())
    optimizer = module.trainer.optimizers[0]
    assert {int(s["step"]) for s in optimizer.state.values()} == {2}  # the skipped steps did not count
    assert not hasattr(optimizer, "found_inf")  # the skip flag does not outlive the run
    if fused:  # skipped on the device: the run went on to the epoch's last batch (5), where the guard's host
        # read, called before Snapshots' hook, stopped it
        assert len(snaps.after) == 5
    else:  # the host read before each step stopped it at the NaN step, before its batch end
        assert len(snaps.after) == 2
    # Without the guard the same run ends with NaN weights: the test above needs the guard to pass.
    module, _, err = fit_nan(fused, guard=False)
    assert err is None and not all(torch.isfinite(v).all() for v in module.state_dict().values())

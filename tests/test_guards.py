"""PitfallGuards: each faulty model gets one warning naming the culprit; a correct model gets none.

Each test fails when its guard is removed: it unpacks exactly one PitfallWarning (no warning, or one per module the
bad tensor passes through, both fail).
"""

import warnings

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from project.callbacks import PitfallGuards
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

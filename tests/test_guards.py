"""PitfallGuards: each faulty model gets a warning naming the culprit; a correct model gets none."""

import warnings

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from project.callbacks import PitfallGuards
from project.callbacks.pitfall_guards import PitfallWarning
from project.models import ConvNet
from project.module import ClassificationModule


def fit_two_steps(module: L.LightningModule, dtype=torch.float32, expect_error: bool = False) -> list[str]:
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
            trainer.fit(module, DataLoader(data, batch_size=4))
        except Exception:
            if not expect_error:
                raise
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


def test_correct_model_gives_no_warning():
    assert fit_two_steps(module_with(ConvNet(num_classes=10, in_channels=1, width=8))) == []


def test_softmax_before_cross_entropy():
    (msg,) = fit_two_steps(module_with(SoftmaxHead()))
    assert "probabilities" in msg and "'model' (SoftmaxHead)" in msg and "logits" in msg


def test_plain_python_list_of_layers():
    msgs = fit_two_steps(module_with(PlainList()))
    assert any("plain Python list 'blocks'" in m and "nn.ModuleList" in m and "PlainList" in m for m in msgs)


def test_parameters_without_gradient():
    (msg,) = fit_two_steps(module_with(UnusedBranch()))
    assert "no gradient" in msg and "model.aux.weight" in msg and "model.aux.bias" in msg


def test_float64_inputs():
    msgs = fit_two_steps(module_with(Head()).double(), dtype=torch.float64)
    assert any("float64" in m and "fc" in m for m in msgs)


def test_batch_on_another_device_than_the_module():
    # On a CPU-only machine the mismatched op then fails; the warning naming the tensor comes first.
    msgs = fit_two_steps(module_with(WrongDevice()), expect_error=True)
    assert any("Input 0 of 'model.fc'" in m and "meta" in m and "cpu" in m for m in msgs)


def test_parameters_unchanged_by_the_optimizer():
    (msg,) = fit_two_steps(FrozenInOptimizer(Head(), num_classes=10))
    assert "did not change" in msg and "model.fc.bias" in msg and "model.fc.weight" not in msg

"""Every classifier torchvision lists gets its head resized: built on the meta device (no memory, no compute), and
the smallest of each model class run forward there."""

import contextlib
from unittest import mock

import pytest
import torch
import torchvision
from torch import nn

from project.models import TorchvisionClassifier

SIZES = {"inception_v3": 299}  # the others take 224 (the ViTs and MaxViT nothing else)


@contextlib.contextmanager
def meta_parameters():
    """Parameters and buffers move to the meta device as they are registered, and their initialisation is skipped
    (on meta it computes nothing, yet torch runs each random fill through its Python reference: half the build).

    Not `with torch.device("meta")`: RegNet's builder computes its widths with tensors and `.tolist()`, which a
    meta tensor cannot give ("Cannot copy out of meta tensor").
    """
    register_parameter, register_buffer = nn.Module.register_parameter, nn.Module.register_buffer

    def skipped_on_meta(fill):
        return lambda tensor, *args, **kwargs: tensor if tensor.is_meta else fill(tensor, *args, **kwargs)

    def parameter(self, name, param):
        register_parameter(
            self, name, None if param is None else nn.Parameter(param.to("meta"), param.requires_grad)
        )

    def buffer(self, name, tensor, persistent=True):
        register_buffer(self, name, None if tensor is None else tensor.to("meta"), persistent)

    with (
        mock.patch.object(nn.Module, "register_parameter", parameter),
        mock.patch.object(nn.Module, "register_buffer", buffer),
        mock.patch.object(torch.Tensor, "normal_", skipped_on_meta(torch.Tensor.normal_)),
        mock.patch.object(torch.Tensor, "uniform_", skipped_on_meta(torch.Tensor.uniform_)),
    ):
        yield


NAMES = torchvision.models.list_models(module=torchvision.models)


@pytest.fixture(scope="module")
def built() -> dict[str, TorchvisionClassifier | Exception]:
    """Every classifier, built on the meta device (or the error its build raised, for its own test to raise)."""
    models: dict[str, TorchvisionClassifier | Exception] = {}
    for name in NAMES:
        try:
            with meta_parameters():
                models[name] = TorchvisionClassifier(name, num_classes=7)
        except Exception as err:  # noqa: BLE001 (raised again by the test of this name)
            models[name] = err
    return models


@pytest.fixture(scope="module")
def forwarded(built: dict) -> set[str]:
    """The smallest builder of each model class: a meta forward costs ~1 ms per op, and builders of one class
    (resnet18 ... resnet152, efficientnet_b0 ... v2_l) share its forward and so where its head sits."""
    smallest: dict[type, tuple[int, str]] = {}
    for name, model in built.items():
        if isinstance(model, nn.Module):
            size = (sum(p.numel() for p in model.parameters()), name)
            smallest[type(model.net)] = min(smallest.get(type(model.net), size), size)
    return {name for _, name in smallest.values()}


@pytest.mark.parametrize("name", NAMES)
def test_every_torchvision_classifier_gets_a_num_classes_head(name, built, forwarded):
    model = built[name]
    if isinstance(model, Exception):
        raise model
    assert {p.device.type for p in model.parameters()} == {"meta"}
    head = [m for m in model.net.modules() if isinstance(m, (nn.Linear, nn.Conv2d))][-1]
    assert (head.out_features if isinstance(head, nn.Linear) else head.out_channels) == 7
    if name in forwarded:
        size = SIZES.get(name, 224)
        # In train mode (the harder one: googlenet and inception_v3 return (logits, aux) unless their aux heads go)
        assert model.train()(torch.empty(2, 3, size, size, device="meta")).shape == (2, 7)

"""Every classifier torchvision lists gets its head resized: built on the meta device (no memory, no compute)."""

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
    """Parameters and buffers move to the meta device as they are registered, before any initialisation runs.

    Not `with torch.device("meta")`: RegNet's builder computes its widths with tensors and `.tolist()`, which a
    meta tensor cannot give ("Cannot copy out of meta tensor").
    """
    register_parameter, register_buffer = nn.Module.register_parameter, nn.Module.register_buffer

    def parameter(self, name, param):
        register_parameter(
            self, name, None if param is None else nn.Parameter(param.to("meta"), param.requires_grad)
        )

    def buffer(self, name, tensor, persistent=True):
        register_buffer(self, name, None if tensor is None else tensor.to("meta"), persistent)

    with (
        mock.patch.object(nn.Module, "register_parameter", parameter),
        mock.patch.object(nn.Module, "register_buffer", buffer),
    ):
        yield


@pytest.mark.parametrize("name", torchvision.models.list_models(module=torchvision.models))
def test_every_torchvision_classifier_gets_a_num_classes_head(name):
    with meta_parameters():
        model = TorchvisionClassifier(name, num_classes=7)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    size = SIZES.get(name, 224)
    # In train mode (the harder one: googlenet and inception_v3 return (logits, aux) unless their aux heads go)
    assert model.train()(torch.empty(2, 3, size, size, device="meta")).shape == (2, 7)

import pytest
import torch

from project.models import ConvNet, TorchvisionClassifier


@pytest.mark.parametrize("shape", [(1, 8, 8), (3, 32, 32), (1, 28, 28)])
def test_convnet_maps_any_small_image_to_logits(shape):
    model = ConvNet(num_classes=7, in_channels=shape[0], width=8)
    assert model(torch.randn(2, *shape)).shape == (2, 7)


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3_small", "shufflenet_v2_x0_5"])
def test_torchvision_head_is_resized(name):
    model = TorchvisionClassifier(name, num_classes=4)
    assert model.eval()(torch.randn(2, 3, 32, 32)).shape == (2, 4)


def test_torchvision_grey_images_are_repeated_to_rgb():
    model = TorchvisionClassifier("resnet18", num_classes=3, in_channels=1).eval()
    assert model(torch.randn(2, 1, 32, 32)).shape == (2, 3)


# Heads: a Linear, a 1x1 Conv2d, a Linear plus aux heads (dropped: train-mode forward returns logits alone).
@pytest.mark.parametrize("name", ["resnet18", "squeezenet1_1", "googlenet"])
def test_torchvision_heads_in_train_mode(name):
    model = TorchvisionClassifier(name, num_classes=3)
    assert model(torch.randn(2, 3, 64, 64)).shape == (2, 3)


def test_torchvision_unknown_model_is_torchvisions_error():
    with pytest.raises(ValueError, match="Unknown model"):
        TorchvisionClassifier("resnet_does_not_exist", num_classes=3)

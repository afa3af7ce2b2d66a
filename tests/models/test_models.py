import pytest
import torch

from project.errors import ConfigError
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


def test_torchvision_local_weights_file(tmp_path):
    source = TorchvisionClassifier("resnet18", num_classes=10)
    path = tmp_path / "resnet18.pth"
    torch.save(source.net.state_dict(), path)
    model = TorchvisionClassifier("resnet18", num_classes=3, weights=str(path))
    assert torch.equal(model.net.conv1.weight, source.net.conv1.weight)
    assert model.net.fc.out_features == 3


def test_torchvision_errors_name_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="list_models"):
        TorchvisionClassifier("resnet_does_not_exist", num_classes=3)
    with pytest.raises(ConfigError, match="classification head"):
        TorchvisionClassifier("squeezenet1_1", num_classes=3)  # a conv head: no Linear to resize
    with pytest.raises(ConfigError, match="does not exist"):
        TorchvisionClassifier("resnet18", num_classes=3, weights=str(tmp_path / "missing.pth"))

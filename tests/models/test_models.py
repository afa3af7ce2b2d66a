import pytest
import torch
import torchvision

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


# Heads: a Linear, a 1x1 Conv2d, a Linear plus aux heads. Weights: a TorchvisionClassifier's net (10 classes, no
# aux heads) or torchvision's model (1000 classes, aux heads).
@pytest.mark.parametrize("name", ["resnet18", "squeezenet1_1", "googlenet"])
@pytest.mark.parametrize("ours", [True, False])
def test_torchvision_local_weights_file(tmp_path, name, ours):
    source = TorchvisionClassifier(name, num_classes=10).net if ours else torchvision.models.get_model(name)
    path = tmp_path / f"{name}.pth"
    torch.save(source.state_dict(), path)
    model = TorchvisionClassifier(name, num_classes=3, weights=str(path))
    first = next(iter(source.state_dict()))  # the stem's first weight
    assert torch.equal(model.net.state_dict()[first], source.state_dict()[first])
    assert model(torch.randn(2, 3, 64, 64)).shape == (2, 3)  # train mode: logits alone


def test_torchvision_errors_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="Unknown model"):
        TorchvisionClassifier("resnet_does_not_exist", num_classes=3)
    with pytest.raises(ConfigError, match="does not exist"):
        TorchvisionClassifier("resnet18", num_classes=3, weights=str(tmp_path / "missing.pth"))

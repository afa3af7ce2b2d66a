"""Any `torchvision.models` classifier by name, with its head resized to `num_classes`."""

from pathlib import Path

import torch
from torch import Tensor, nn

from project.errors import ConfigError


class TorchvisionClassifier(nn.Module):
    """A `torchvision.models` classifier, e.g. `resnet18`, `mobilenet_v3_small`, `efficientnet_b0`.

    Args:
        name: the builder's name in `torchvision.models` (`torchvision.models.list_models()` lists them).
        num_classes: size of the new head; linked from the data module by the CLI.
        weights: None for random init, or a torchvision weights name (`DEFAULT`, `IMAGENET1K_V1`), loaded from
            torchvision's cache (downloaded into it when online).
        in_channels: image channels; 1-channel images are repeated to 3 when the model expects 3.
    """

    def __init__(self, name: str, num_classes: int, weights: str | None = None, in_channels: int = 3) -> None:
        super().__init__()
        import torchvision

        self.in_channels = in_channels
        try:
            self.net = torchvision.models.get_model(name, weights=weights)
        except OSError as err:  # not in torchvision's cache and the download failed (URLError is an OSError)
            url = torchvision.models.get_model_weights(name).verify(weights).url
            raise ConfigError(
                f"Pretrained weights {name} {weights} are not in torchvision's cache and could not be downloaded "
                f"({type(err).__name__}: {err}). On a machine with network access, download {url} and put it at "
                f"{Path(torch.hub.get_dir()) / 'checkpoints' / Path(url).name} (TORCH_HOME moves this cache)."
            ) from err
        # googlenet, inception_v3: drop the aux heads, so that train-mode forward returns logits, not a tuple
        if getattr(self.net, "aux_logits", False):
            self.net.aux_logits, self.net.aux1, self.net.aux2, self.net.AuxLogits = False, None, None, None
        # The head of every torchvision classifier: its last Linear, or 1x1 Conv2d (SqueezeNet's).
        head = [n for n, m in self.net.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))][-1]
        old = self.net.get_submodule(head)
        if isinstance(old, nn.Linear):
            self.net.set_submodule(head, nn.Linear(old.in_features, num_classes))
        else:
            self.net.set_submodule(head, nn.Conv2d(old.in_channels, num_classes, 1))

    def forward(self, x: Tensor) -> Tensor:  # (B, C, H, W) -> (B, num_classes)
        if x.shape[1] == 1 and self.in_channels == 1:
            x = x.expand(-1, 3, -1, -1)  # ImageNet models take RGB
        return self.net(x)

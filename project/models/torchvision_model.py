"""Any `torchvision.models` classifier by name, with its head resized to `num_classes`."""

from pathlib import Path

import torch
from torch import Tensor, nn

from project.errors import ConfigError

_HEADS = ("fc.", "classifier.", "head.", "heads.")  # state-dict prefixes of the layers _replace_head swaps


def _replace_head(model: nn.Module, num_classes: int) -> None:
    """Swap the last Linear layer (fc, classifier[-1], heads.head, ...) for one with `num_classes` outputs."""
    for attr in ("fc", "classifier", "head", "heads"):
        holder = getattr(model, attr, None)
        if holder is None:
            continue
        if isinstance(holder, nn.Linear):
            setattr(model, attr, nn.Linear(holder.in_features, num_classes))
            return
        linears = [(name, m) for name, m in holder.named_modules() if isinstance(m, nn.Linear)]
        if linears:
            name, last = linears[-1]
            parent = holder.get_submodule(name.rpartition(".")[0]) if "." in name else holder
            setattr(parent, name.rpartition(".")[2], nn.Linear(last.in_features, num_classes))
            return
    raise ConfigError(f"Cannot find the classification head of {type(model).__name__} to resize it.")


class TorchvisionClassifier(nn.Module):
    """A `torchvision.models` classifier, e.g. `resnet18`, `mobilenet_v3_small`, `efficientnet_b0`.

    Args:
        name: the builder's name in `torchvision.models` (`torchvision.models.list_models()` lists them).
        num_classes: size of the new head; linked from the data module by the CLI.
        weights: None for random init, a torchvision weights name (`DEFAULT`, `IMAGENET1K_V1`) loaded from
            torchvision's cache, or the path of a local `.pth` state dict.
        in_channels: image channels; 1-channel images are repeated to 3 when the model expects 3.
    """

    def __init__(self, name: str, num_classes: int, weights: str | None = None, in_channels: int = 3) -> None:
        super().__init__()
        import torchvision

        if name not in torchvision.models.list_models(module=torchvision.models):
            raise ConfigError(
                f"Unknown torchvision model '{name}'. Pick one of torchvision.models.list_models(), "
                "for example resnet18, and set it with --model.init_args.model.init_args.name."
            )
        self.in_channels = in_channels
        use_builtin = weights is not None and not Path(weights).suffix
        try:
            self.net = torchvision.models.get_model(name, weights=weights if use_builtin else None)
        except OSError as err:  # not in torchvision's cache and the download failed (URLError is an OSError)
            raise ConfigError(_weights_unavailable(name, weights, err)) from err
        if weights is not None and not use_builtin:
            missing, unexpected = self.net.load_state_dict(_load_local_weights(weights), strict=False)
            missing = [k for k in missing if not k.startswith(_HEADS)]  # the head is replaced below anyway
            if missing or unexpected:  # strict=False alone would silently keep random weights
                raise ConfigError(
                    f"'{weights}' does not fit torchvision's {name}: {len(missing)} missing keys (e.g. "
                    f"{missing[:3]}), {len(unexpected)} unexpected (e.g. {unexpected[:3]}). Use a state dict of {name}."
                )
        _replace_head(self.net, num_classes)

    def forward(self, x: Tensor) -> Tensor:  # (B, C, H, W) -> (B, num_classes)
        if x.shape[1] == 1 and self.in_channels == 1:
            x = x.expand(-1, 3, -1, -1)  # ImageNet models take RGB
        return self.net(x)


def _load_local_weights(path: str) -> dict:
    if not Path(path).is_file():
        raise ConfigError(
            f"Pretrained weights file '{path}' does not exist. Put a torchvision state dict (.pth) there, "
            "or set weights to a torchvision name such as DEFAULT when the file is in torchvision's cache "
            f"({torch.hub.get_dir()}/checkpoints)."
        )
    state = torch.load(path, map_location="cpu", weights_only=True)
    # Drop the old head: it is replaced for num_classes anyway.
    return {k: v for k, v in state.items() if not k.startswith(_HEADS)}


def _weights_unavailable(name: str, weights: str, err: Exception) -> str:
    """Where torchvision looks for the weights file, so it can be placed there by hand on an offline machine."""
    import torchvision

    url = torchvision.models.get_weight(
        f"{type(torchvision.models.get_model_weights(name).DEFAULT).__name__}.{weights}"
    ).url
    path = Path(torch.hub.get_dir()) / "checkpoints" / Path(url).name
    return (
        f"Pretrained weights {name} {weights} are not in torchvision's cache and could not be downloaded "
        f"({type(err).__name__}: {err}). On a machine with network access, download {url} and put it at "
        f"{path} (TORCH_HOME moves this cache), or set weights to the path of a local .pth state dict."
    )

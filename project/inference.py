"""A trained checkpoint, ready for inference: the model in eval mode plus the preprocessing saved at training.

Shared by `predict` and `export`. Checkpoints are read with `weights_only=True` (no pickled code runs), in
one function, `load_checkpoint`, so a project-wide safe loader can replace it later.
"""

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from project.errors import ConfigError


@dataclass
class Preprocessing:
    """What the data module saved in the checkpoint: enough to turn an image file into a model input."""

    class_names: list[str]
    mean: list[float]
    std: list[float]
    input_shape: tuple[int, int, int]  # (C, H, W)

    def transform(self):
        """The evaluation transform of training: to float in [0, 1], resize to (H, W), normalise."""
        from project.data.transforms import build_transform

        return build_transform(
            "none", self.mean, self.std, train=False, augment=False, size=self.input_shape[1:]
        )

    def to_json(self) -> dict:
        return {
            "class_names": self.class_names,
            "input_shape": list(self.input_shape),
            "mean": self.mean,
            "std": self.std,
            "pixel_scale": "divide 8-bit pixels by 255, resize to input_shape[1:], then (x - mean) / std per channel",
            "color": "grayscale" if self.input_shape[0] == 1 else "RGB",
            "output": "logits; softmax gives class probabilities in class_names order",
        }


def load_checkpoint(path: str | Path) -> dict:
    """Read a Lightning checkpoint without executing pickled code."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"Checkpoint '{path}' does not exist. Pass one written by `make train`, e.g. "
            "CKPT=runs/<run>/checkpoints/last.ckpt (or best-epoch=NNN.ckpt)."
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # UnpicklingError for foreign objects, RuntimeError for a corrupt zip
        raise ConfigError(
            f"Cannot read checkpoint '{path}' safely (weights_only=True): {type(err).__name__}: {err}. "
            "Use a checkpoint written by this project's `make train`."
        ) from err


def preprocessing_of(checkpoint: dict, path: str | Path = "checkpoint") -> Preprocessing:
    # The data module's state_dict is stored under its class name; find it by content, not by name.
    state = next((v for v in checkpoint.values() if isinstance(v, dict) and "class_names" in v), None)
    if state is None or state.get("mean") is None:
        raise ConfigError(
            f"'{path}' holds no class names and normalisation (the data module's state). "
            "It was not written by this project's `make train`; retrain, or use a checkpoint from runs/<run>/checkpoints/."
        )
    c, h, w = state["input_shape"]
    return Preprocessing(list(state["class_names"]), list(state["mean"]), list(state["std"]), (c, h, w))


def build_model(checkpoint: dict, path: str | Path = "checkpoint") -> nn.Module:
    """Rebuild the LightningModule from the saved hyperparameters and load its weights; eval mode, CPU."""
    import lightning as L
    from lightning.pytorch.cli import instantiate_module

    hparams = copy.deepcopy(checkpoint.get("hyper_parameters") or {})
    hparams.pop("_instantiator", None)
    if "_class_path" not in hparams or not isinstance(hparams.get("model"), dict):
        raise ConfigError(
            f"'{path}' does not record how to rebuild its model (no LightningCLI hyperparameters). "
            "Train with `make train` (python -m project fit), which saves them."
        )
    # The state dict below overwrites every weight, so do not load pretrained weights again (the file or
    # the network may be gone by now).
    init_args = hparams["model"].get("init_args", {})
    if "weights" in init_args:
        init_args["weights"] = None
    module = instantiate_module(L.LightningModule, hparams)  # the class named by _class_path
    module.load_state_dict(checkpoint["state_dict"])
    return module.eval()

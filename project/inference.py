"""A trained checkpoint, ready for inference: the model in eval mode plus the preprocessing saved at training.
Shared by predict and export, which must start fast: no Lightning, torchmetrics or torchvision (but for a
torchvision model)."""

import copy
import os
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from project.checkpoint import check_class_paths, instantiate
from project.data.normalize import contract_gaps, normalize, resize
from project.errors import ConfigError


@dataclass
class Preprocessing:
    """The data module's saved state: an image -> training's evaluation input, by training's own functions."""

    class_names: list[str]
    mean: list[float]
    std: list[float]
    input_shape: tuple[int, int, int]  # (C, H, W)

    def image(self, image) -> Tensor:
        """A PIL image, converted to the checkpoint's grey or RGB -> the normalised (C, H, W) float32 input."""
        pixels = torch.from_numpy(np.array(image.convert("L" if self.input_shape[0] == 1 else "RGB")))
        return self.tensor(pixels.view(*pixels.shape[:2], -1).permute(2, 0, 1))  # (H, W, C) -> (C, H, W)

    def tensor(self, x: Tensor) -> Tensor:
        """A (C, H, W) image (uint8, or float in [0, 1]) -> the normalised float32 model input."""
        mean, std = (torch.tensor(v, dtype=torch.float32).view(-1, 1, 1) for v in (self.mean, self.std))
        return normalize(resize(x, self.input_shape[1:]), mean, std)


def preprocessing_of(checkpoint: dict, path: str | os.PathLike = "checkpoint") -> Preprocessing:
    # The data module's state is stored under its class name: found by content.
    key = next((k for k, v in checkpoint.items() if isinstance(v, dict) and "class_names" in v), None)
    state = checkpoint[key] if key else {}
    if state.get("dataset") and state.get("mean") is None:
        raise ConfigError(
            f"'{path}' was trained on {state['dataset']} (a DatasetDataModule): `predict` and `export` take "
            "checkpoints of image classifiers only. Evaluate it: python -m project test --config <the config you "
            f"trained with, e.g. configs/sequence.yaml> --ckpt_path {path}; in Python: module = project.inference."
            "build_model(project.checkpoint.read_checkpoint(p), p), then module(inputs)."
        )
    if gaps := contract_gaps(state):
        data = (checkpoint.get("datamodule_hyper_parameters") or {}).get("_class_path") or key
        raise ConfigError(
            f"'{path}' lacks {', '.join(gaps)} in its data module's state, which predict and export read: the data "
            f"module{f' ({data})' if data else ''} must return class_names, input_shape ((C, H, W)), mean and std "
            '(per channel, for pixels in [0, 1]) from state_dict() (docs/data.md "Predict and export"), e.g.\n'
            "    def state_dict(self):\n"
            '        return {"class_names": self.class_names, "input_shape": [3, 32, 32],\n'
            '                "mean": [0.49, 0.48, 0.45], "std": [0.25, 0.24, 0.26]}\n'
            "and train again: a checkpoint holds what its run saved."
        )
    c, h, w = state["input_shape"]
    return Preprocessing(list(state["class_names"]), list(state["mean"]), list(state["std"]), (c, h, w))


def _module_hparams(checkpoint: dict, path, allow, dotted_strings: bool = False) -> dict:
    """The LightningModule's stored hyperparameters, every class path in them checked against the allowlist."""
    hparams = copy.deepcopy(checkpoint.get("hyper_parameters") or {})
    hparams.pop("_instantiator", None)  # names Lightning's function that rebuilt it; nothing imports it here
    if "_class_path" not in hparams or not isinstance(hparams.get("model"), dict):
        raise ConfigError(
            f"'{path}' does not record how to rebuild its model (no LightningCLI hyperparameters). "
            "Train with `make train` (python -m project fit), which saves them."
        )
    check_class_paths(hparams, allow, path, dotted_strings)
    # The state dict overwrites every weight: pretrained weights are not fetched again (they may be gone by now).
    if "weights" in (init_args := hparams["model"].get("init_args") or {}):
        init_args["weights"] = None
    return hparams


def load_model(checkpoint: dict, path: str | os.PathLike = "checkpoint", allow=()) -> nn.Module:
    """The trained nn.Module (the LightningModule's `model`) in eval mode, on the CPU, built without Lightning."""
    model = instantiate(_module_hparams(checkpoint, path, allow)["model"], allow)
    try:
        model.load_state_dict({k[6:]: v for k, v in checkpoint["state_dict"].items() if k[:6] == "model."})
    except RuntimeError as err:
        raise ConfigError(
            f"'{path}': the weights do not fit the model its hyperparameters describe "
            f"({str(err).strip().splitlines()[0][:200]}). The file was edited or mixes two runs; use a checkpoint "
            "from runs/<run>/checkpoints/ as training wrote it."
        ) from err
    return model.eval()


def build_model(checkpoint: dict, path: str | os.PathLike = "checkpoint", allow=()):
    """The whole LightningModule in eval mode, rebuilt by Lightning's instantiate_module after every string
    jsonargparse could import is checked, not only the class paths."""
    hparams = _module_hparams(checkpoint, path, allow, dotted_strings=True)
    import lightning as L
    from lightning.pytorch.cli import instantiate_module

    module = instantiate_module(L.LightningModule, hparams)
    module.load_state_dict(checkpoint["state_dict"])
    return module.eval()

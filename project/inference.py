"""A trained checkpoint, ready for inference: the model in eval mode plus the preprocessing saved at training.

Shared by `predict` and `export`, which must start fast: nothing here imports Lightning, torchmetrics,
matplotlib or torchvision (torchvision comes in only when the checkpoint's model is a torchvision model).
Checkpoints are read by project/checkpoint.py (weights_only=True), and every class the checkpoint names is
checked against the allowlist there before anything is imported.
"""

import copy
import os
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from project.checkpoint import check_class_paths, instantiate
from project.data.normalize import normalize, resize
from project.errors import ConfigError


@dataclass
class Preprocessing:
    """What the data module saved in the checkpoint: enough to turn an image file into a model input.

    `image(pil)` and `tensor(x)` run training's preprocessing (project/data/normalize.py): `resize` to the training
    size in the pixels' own type, then `normalize` with the training statistics, the functions every data path
    uses, so the inputs are the evaluation inputs of training (tests compare them) without importing torchvision
    (~1.4 s of a 2.5 s predict).
    """

    class_names: list[str]
    mean: list[float]
    std: list[float]
    input_shape: tuple[int, int, int]  # (C, H, W)

    def image(self, image) -> Tensor:
        """A PIL image -> the normalised (C, H, W) float32 input; converted to the checkpoint's grey or RGB."""
        image = image.convert("L" if self.input_shape[0] == 1 else "RGB")
        pixels = torch.from_numpy(np.array(image, copy=True))  # (H, W) or (H, W, C) uint8
        # (C, H, W) as a view of the (H, W, C) pixels, as torchvision's pil_to_tensor makes it
        return self.tensor(pixels.view(image.size[1], image.size[0], -1).permute(2, 0, 1))

    def tensor(self, x: Tensor) -> Tensor:
        """A (C, H, W) image tensor (uint8 0-255, or float in [0, 1]) -> the normalised float32 model input."""
        x = resize(x, self.input_shape[1:])
        mean = torch.as_tensor(self.mean, dtype=torch.float32).view(-1, 1, 1)
        std = torch.as_tensor(self.std, dtype=torch.float32).view(-1, 1, 1)
        return normalize(x, mean, std)  # the function training normalises with

    def to_json(self) -> dict:
        return {
            "class_names": self.class_names,
            "input_shape": list(self.input_shape),
            "mean": self.mean,
            "std": self.std,
            "pixel_scale": "resize the 8-bit pixels to input_shape[1:] (bilinear, antialiased, as 8-bit), divide by "
            "255, then (x - mean) / std per channel",
            "color": "grayscale" if self.input_shape[0] == 1 else "RGB",
            "output": "logits; softmax gives class probabilities in class_names order",
        }


# The predict/export contract (docs/data.md "Predict and export"): all that predict and export read of the data
# module, from its state_dict() in the checkpoint: class_names (list of str), input_shape ((C, H, W)), and mean and
# std (per-channel lists: the normalisation applied to pixels in [0, 1]).
CONTRACT = ("class_names", "input_shape", "mean", "std")


def contract_gaps(data) -> list[str]:
    """The CONTRACT keys that a data module's state_dict() (or that state itself) lacks or leaves None."""
    state = data.state_dict() if hasattr(data, "state_dict") else data
    return [k for k in CONTRACT if not isinstance(state, dict) or state.get(k) is None]


def preprocessing_of(checkpoint: dict, path: str | os.PathLike = "checkpoint") -> Preprocessing:
    # The data module's state_dict is stored under its class name; find it by content, not by name.
    key = next((k for k, v in checkpoint.items() if isinstance(v, dict) and "class_names" in v), None)
    state = checkpoint[key] if key else {}
    if state.get("dataset") and state.get("mean") is None:
        raise ConfigError(not_image_checkpoint(path, state["dataset"]))
    if gaps := contract_gaps(state):
        data = (checkpoint.get("datamodule_hyper_parameters") or {}).get("_class_path") or key
        raise ConfigError(
            f"'{path}' lacks {', '.join(gaps)} in its data module's state, which predict and export read: "
            f"{f'the data module ({data})' if data else 'the data module'} must return class_names (list of "
            "str), input_shape ((C, H, W)), mean and std (per channel, the normalisation applied to pixels in "
            '[0, 1]) from state_dict() (docs/data.md "Predict and export"), e.g.\n'
            "    def state_dict(self):\n"
            '        return {"class_names": self.class_names, "input_shape": [3, 32, 32],\n'
            '                "mean": [0.49, 0.48, 0.45], "std": [0.25, 0.24, 0.26]}\n'
            "and train again: a checkpoint holds what its run saved."
        )
    c, h, w = state["input_shape"]
    return Preprocessing(list(state["class_names"]), list(state["mean"]), list(state["std"]), (c, h, w))


def not_image_checkpoint(path: str | os.PathLike, dataset: str) -> str:
    """The error of predict and export for a checkpoint trained on a DatasetDataModule (docs/data.md "Any Dataset")."""
    return (
        f"'{path}' was trained on {dataset} (a DatasetDataModule), not on images: `predict` and `export` take "
        "checkpoints of image classifiers only, as they turn image files into the model's input and know nothing of "
        "your dataset or its collate_fn. To evaluate it on its test split: python -m project test --config <the "
        f"config you trained with, e.g. configs/sequence.yaml> --ckpt_path {path}. To run it on your own inputs, "
        f"load it in Python: module = project.inference.build_model(project.checkpoint.read_checkpoint(p), p) "
        "with p the checkpoint path, then module(inputs) with inputs as your collate_fn makes them (README "
        '"Any Dataset").'
    )


def _module_hparams(checkpoint: dict, path: str | os.PathLike) -> dict:
    hparams = copy.deepcopy(checkpoint.get("hyper_parameters") or {})
    hparams.pop("_instantiator", None)  # names Lightning's function that rebuilt it; nothing imports it here
    if "_class_path" not in hparams or not isinstance(hparams.get("model"), dict):
        raise ConfigError(
            f"'{path}' does not record how to rebuild its model (no LightningCLI hyperparameters). "
            "Train with `make train` (python -m project fit), which saves them."
        )
    # The state dict overwrites every weight, so pretrained weights are not loaded again (the file or the
    # network may be gone by now).
    init_args = hparams["model"].get("init_args") or {}
    if "weights" in init_args:
        init_args["weights"] = None
    return hparams


def load_model(
    checkpoint: dict, path: str | os.PathLike = "checkpoint", allow: Iterable[str] = ()
) -> nn.Module:
    """The trained nn.Module (the LightningModule's `model`) with its weights, in eval mode, on the CPU.

    Every class path in the stored hyperparameters is checked first (the optimizer's and scheduler's too, though
    only the model is built); `allow` adds classes or module prefixes the user trusts (--allow_class).
    """
    hparams = _module_hparams(checkpoint, path)
    check_class_paths(hparams, allow, path)
    model = instantiate(hparams["model"], allow)
    prefix = "model."  # ClassificationModule keeps the network as self.model; its forward is model(x)
    state = {k[len(prefix) :]: v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)}
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        raise ConfigError(
            f"'{path}': the weights do not fit the model its hyperparameters describe "
            f"({str(err).strip().splitlines()[0][:200]}). The file was edited or mixes two runs; use a checkpoint "
            "from runs/<run>/checkpoints/ as training wrote it."
        ) from err
    return model.eval()


def build_model(checkpoint: dict, path: str | os.PathLike = "checkpoint", allow: Iterable[str] = ()):
    """The whole LightningModule (its steps, metrics and hooks), rebuilt by Lightning's instantiate_module.

    For code that needs more than the forward pass (tests, evaluation scripts); it imports Lightning. The class
    paths, and every string jsonargparse could import, are checked before Lightning sees them.
    """
    hparams = _module_hparams(checkpoint, path)
    check_class_paths(hparams, allow, path, dotted_strings=True)
    import lightning as L
    from lightning.pytorch.cli import instantiate_module

    module = instantiate_module(L.LightningModule, hparams)  # the class named by _class_path
    module.load_state_dict(checkpoint["state_dict"])
    return module.eval()

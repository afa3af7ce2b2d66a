"""A model whose head does not fit the data fails before training, in one paragraph, not at step 1."""

import torch
from torch import Tensor, nn

from project.errors import ConfigError


def check_output_shape(model: nn.Module, input_shape: tuple[int, ...], num_classes: int) -> None:
    """Fail before training when the model's head does not match the data's classes."""
    try:
        device = next(model.parameters()).device
    except StopIteration:
        device = torch.device("cpu")
    was_training = model.training
    model.eval()  # eval: a dry run must not touch BatchNorm running statistics
    try:
        with torch.no_grad():
            out = model(torch.zeros(2, *input_shape, device=device))
    except Exception as err:
        raise ConfigError(
            f"The model {type(model).__name__} failed on a dummy batch of shape (2, {', '.join(map(str, input_shape))}), "
            f"the data module's input shape: {type(err).__name__}: {err}. "
            "Check the model's in_channels and expected image size against the data."
        ) from err
    finally:
        model.train(was_training)
    if not isinstance(out, Tensor) or out.ndim != 2 or out.shape[1] != num_classes:
        shape = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
        raise ConfigError(
            f"The model {type(model).__name__} returns outputs of shape {shape}, but the data has "
            f"{num_classes} classes, so (batch, {num_classes}) was expected. Give the model a `num_classes` "
            "constructor argument (the CLI fills it in from the data), or set its head size to match: "
            "--model.init_args.model.init_args.num_classes."
        )

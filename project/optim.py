"""The optimizer a module's config names, built on its parameter groups: torch's fused Adam/AdamW kernel where it
applies (and Lightning allows it), the configured optimizer as it is everywhere else; its lr scaled for DDP."""

import inspect

import lightning as L
import torch
from lightning.pytorch.cli import OptimizerCallable
from torch.optim import Optimizer


def build_optimizer(optimizer: OptimizerCallable, groups: list[dict], allow_fused: bool = True) -> Optimizer:
    """`optimizer(groups)`; Adam/AdamW with `fused` unset are rebuilt with fused=True where every parameter allows.

    One kernel for all parameters instead of a loop over them: the same update, a fraction of the host time of
    the step on small models. Other devices (MPS, XLA) keep the default implementation, and so does
    `allow_fused=False` (gradient clipping under mixed precision: see `clips_under_amp`).
    """
    built = optimizer([dict(g) for g in groups])  # copies: an optimizer fills its defaults into the dicts
    d = built.defaults
    if (
        not allow_fused
        or type(built) not in (torch.optim.Adam, torch.optim.AdamW)
        or d.get("fused") is not None
    ):
        return built
    if d.get("foreach") or d.get("differentiable") or not fused_supported(built.param_groups):
        return built
    accepted = inspect.signature(type(built)).parameters
    kwargs = {k: v for k, v in d.items() if k in accepted and k != "fused"}
    return type(built)([dict(g) for g in groups], **kwargs, fused=True)


def clips_under_amp(trainer: "L.Trainer | None") -> bool:
    """Whether the Trainer clips gradients under mixed precision (`gradient_clip_val` with 16-mixed/bf16-mixed).

    Lightning's MixedPrecision plugin refuses to clip for an optimizer that unscales gradients inside its step,
    as fused Adam/AdamW do ("does not allow for gradient clipping"): bf16-mixed is the default on GPUs, so
    `--trainer.gradient_clip_val 1.0` there crashed at the first step. Such runs keep torch's default (foreach)
    AdamW instead; the NaN guard then checks the loss on the host (project/callbacks/nonfinite_loss.py).
    An explicit `fused: true` is left as configured, and Lightning's error names it.
    """
    from lightning.pytorch.plugins.precision import MixedPrecision

    # getattr: a module may be asked for its optimizer with a stand-in trainer that only knows its world size
    return bool(getattr(trainer, "gradient_clip_val", None)) and isinstance(
        getattr(trainer, "precision_plugin", None), MixedPrecision
    )


def fused_supported(groups: list[dict]) -> bool:
    """Whether torch's fused Adam/AdamW kernel can update these parameters (floating point, on CPU or CUDA)."""
    params = [p for g in groups for p in g["params"]]
    return bool(params) and all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)


def lr_scale(lr_scaling: str, world_size: int) -> int:
    """The factor on every group's lr: the world size under `lr_scaling: linear` (the linear scaling rule for a
    global batch that grows with the processes), else 1."""
    return world_size if lr_scaling == "linear" else 1


def configured_lr(optimizer: OptimizerCallable) -> float:
    """The lr an optimizer config sets, before any scaling: that of one built on a stand-in parameter."""
    return optimizer([torch.nn.Parameter(torch.zeros(1))]).defaults["lr"]


def scale_lr(optimizer: Optimizer, scale: float) -> None:
    """Multiply every group's lr (and the default) by `scale`; call it before a scheduler records the peaks."""
    if scale != 1:
        for group in optimizer.param_groups:
            group["lr"] *= scale
        optimizer.defaults["lr"] *= scale

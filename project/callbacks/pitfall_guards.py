"""PitfallGuards: one warning for each classic silent training bug, looked for at the first step only."""

import warnings
from functools import partial

import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn


class PitfallWarning(UserWarning):
    """A probable bug in the model or the data, found by PitfallGuards."""


class PitfallGuards(Callback):
    """Looks at the first training step for bugs that train badly without an error (Lightning warns of none):
    layers in a plain Python list or dict; float64 inputs, or inputs on another device than the module receiving
    them (nested ones too); outputs that are probabilities (a softmax before CrossEntropyLoss); parameters with no
    gradient after the first backward, or unchanged by the first optimizer step (not in the optimizer).

    Then it leaves `trainer.callbacks` (a new list: Lightning iterates the one it read): later steps skip it.
    """

    def on_fit_start(self, trainer, pl_module) -> None:
        self._found, self._before, self._handles = set(), {}, []
        for name, module in pl_module.named_modules():
            for attr, value in vars(module).items():
                layers = value.values() if isinstance(value, dict) else value
                plain = isinstance(value, dict | list | tuple) and not attr.startswith("_")
                if plain and any(isinstance(v, nn.Module) for v in layers):
                    where = f"{type(module).__name__} '{name or 'model'}' keeps layers in a plain Python"
                    fix = "they are neither trained nor saved. Use nn.ModuleList / nn.ModuleDict."
                    self._warn(f"{name}.{attr}", f"{where} {type(value).__name__} '{attr}': {fix}")
            name = name or type(module).__name__
            pre, post = partial(self._inputs, name), partial(self._outputs, name)
            self._handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            self._handles.append(module.register_forward_hook(post))

    def _warn(self, finding: str, message: str) -> None:
        # Once per finding; pre-hooks fire outermost first, forward hooks innermost: the first module to see it.
        if finding not in self._found:
            self._found.add(finding)
            warnings.warn(message, PitfallWarning, stacklevel=3)

    def _inputs(self, name: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        param = next(module.parameters(recurse=False), None)
        for i, x in _tensors({**dict(enumerate(args)), **kwargs}):
            where = f"Input {i} of '{name}' ({type(module).__name__})"
            if x.dtype == torch.float64:
                self._warn("float64", f"{where} is float64 (twice the memory, slow): use float32.")
            if param is not None and x.device != param.device:
                self._warn("device", f"{where} is on {x.device} but its parameters are on {param.device}.")

    def _outputs(self, name: str, module: nn.Module, args: tuple, out) -> None:
        if "softmax" in self._found or not isinstance(out, Tensor) or out.ndim != 2 or out.shape[1] < 2:
            return
        floating, out = out.is_floating_point(), out.detach().float()
        in_unit = floating and bool(((out >= 0) & (out <= 1)).all())
        if in_unit and torch.allclose(out.sum(1), out.new_ones(len(out)), atol=1e-3):
            what = f"The outputs of '{name}' ({type(module).__name__}) are probabilities"
            self._warn("softmax", f"{what}: CrossEntropyLoss expects logits. Remove the final softmax.")

    def on_after_backward(self, trainer, pl_module) -> None:
        self.teardown(trainer, pl_module, "fit")  # the module hooks go
        if unused := [n for n, p in pl_module.named_parameters() if p.requires_grad and p.grad is None]:
            what = f"{len(unused)} parameters got no gradient: {', '.join(unused[:5])}"
            self._warn("no gradient", f"{what}; unused in forward (or detached)? Remove them, or use them.")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if str(trainer.precision) != "16-mixed":  # fp16 AMP skips overflowing steps while it calibrates
            named = pl_module.named_parameters()
            self._before = {n: p.detach().clone() for n, p in named if p.grad is not None and p.grad.any()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self.teardown(trainer, pl_module, "fit")
        params = dict(pl_module.named_parameters())
        if frozen := [n for n, before in self._before.items() if torch.equal(params[n].detach(), before)]:
            what = f"{len(frozen)} parameters did not change in the first optimizer step: {', '.join(frozen[:5])}"
            self._warn("unchanged", f"{what}; missing from configure_optimizers, or at learning rate 0?")
        self._before = {}
        trainer.callbacks = [c for c in trainer.callbacks if c is not self]

    def teardown(self, trainer, pl_module, stage: str) -> None:
        for handle in getattr(self, "_handles", []):
            handle.remove()
        self._handles = []


def _tensors(inputs, prefix: str = ""):
    """(name, tensor) for every tensor in nested dicts, tuples and lists: `0`, `lengths`, `0.x`."""
    for key, value in inputs.items() if isinstance(inputs, dict) else enumerate(inputs):
        if isinstance(value, Tensor):
            yield f"{prefix}{key}", value
        elif isinstance(value, dict | list | tuple):
            yield from _tensors(value, f"{prefix}{key}.")

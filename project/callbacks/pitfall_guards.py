"""PitfallGuards: warnings for classic silent training bugs, checked on the first step only."""

import warnings

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn


class PitfallWarning(UserWarning):
    """A probable bug in the model or the data, found by PitfallGuards."""


class PitfallGuards(Callback):
    """Looks at the first training step for bugs that train without an error but train badly or not at all.

    - layers kept in a plain Python list/dict attribute (their parameters are never registered or trained);
    - float64 inputs, and input tensors on another device than the module that receives them (positional and
      keyword inputs, and tensors nested in dicts, tuples and lists: a DatasetDataModule's batches);
    - outputs that already look like probabilities (a softmax before CrossEntropyLoss, which applies its own);
    - parameters with no gradient after the first backward (an unused branch or layer);
    - parameters unchanged by the first optimizer step although they have a gradient (not in the optimizer).

    After the first step its module hooks are removed and it takes itself out of `trainer.callbacks` (a new list:
    Lightning iterates the list it read, and removing from that one while a hook runs would skip the next
    callback), so later steps do not even call into it. A correct model gets no warning. A second `fit` on the
    same Trainer runs without it.

    Why not Lightning's stock tools: ModelSummary lists parameters but not unregistered ones, and nothing in
    Lightning warns about softmax outputs, float64 inputs, missing gradients or parameters left out of the
    optimizer.
    """

    def __init__(self) -> None:
        self._handles: list = []
        self._before: dict[str, Tensor] = {}
        self._done = False

    def on_fit_start(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        self._done = False
        for name, module in pl_module.named_modules():
            for attr, value in vars(module).items():
                items = (
                    value.values()
                    if isinstance(value, dict)
                    else value
                    if isinstance(value, (list, tuple))
                    else ()
                )
                if not attr.startswith("_") and any(isinstance(v, nn.Module) for v in items):
                    _warn(
                        f"{type(module).__name__} '{name or 'model'}' keeps layers in a plain Python "
                        f"{type(value).__name__} '{attr}': their parameters are not registered, so they are neither "
                        "trained nor saved. Use nn.ModuleList / nn.ModuleDict instead."
                    )
        self._probabilities_seen = False
        # One warning per finding: a float64 or wrong-device batch reaches every module on its way; the first
        # module that receives it (pre-hooks fire outermost first) is the one named.
        self._input_findings: set[str] = set()
        self._handles = []
        for name, module in pl_module.named_modules():
            name = name or type(module).__name__
            self._handles.append(module.register_forward_pre_hook(self._input_check(name), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._output_check(name)))

    def _input_check(self, name: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            param = next(module.parameters(recurse=False), None)
            for i, x in _tensors({**dict(enumerate(args)), **kwargs}):
                if x.dtype == torch.float64 and "float64" not in self._input_findings:
                    self._input_findings.add("float64")
                    _warn(
                        f"Input {i} of '{name}' ({type(module).__name__}) is float64: twice the memory and a slow "
                        "path. Convert the data to float32 (tensor.float()) in the dataset."
                    )
                if param is not None and x.device != param.device and "device" not in self._input_findings:
                    self._input_findings.add("device")
                    _warn(
                        f"Input {i} of '{name}' ({type(module).__name__}) is on {x.device} but its parameters are on "
                        f"{param.device}. Create tensors with device=self.device or move the batch before use."
                    )

        return hook

    def _output_check(self, name: str):
        def hook(module: nn.Module, args: tuple, out) -> None:
            # Forward hooks fire innermost first: the first module flagged is the one that applies the softmax.
            if self._probabilities_seen or not isinstance(out, Tensor) or out.ndim != 2 or out.shape[1] < 2:
                return
            if not out.is_floating_point():
                return
            out = out.detach().float()
            if bool(((out >= 0) & (out <= 1)).all()) and torch.allclose(
                out.sum(1), torch.ones_like(out[:, 0]), atol=1e-3
            ):
                self._probabilities_seen = True
                _warn(
                    f"The outputs of '{name}' ({type(module).__name__}) are probabilities (each row is in [0, 1] and "
                    "sums to 1): CrossEntropyLoss expects raw logits and applies log-softmax itself. Remove the "
                    "final softmax from the model (apply it only in predict)."
                )

        return hook

    def on_after_backward(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        if self._done:
            return
        self._remove_hooks()
        unused = [n for n, p in pl_module.named_parameters() if p.requires_grad and p.grad is None]
        if unused:
            _warn(
                f"{len(unused)} parameters got no gradient in the first backward: {', '.join(unused[:5])}. The "
                "layer or branch is not used in forward (or its output is detached); remove it, or use it."
            )

    def on_before_optimizer_step(
        self, trainer: "L.Trainer", pl_module: "L.LightningModule", optimizer
    ) -> None:
        # fp16 AMP skips steps whose gradients overflow while its loss scale calibrates: not a bug.
        if not self._done and "16-mixed" != str(trainer.precision):
            self._before = {
                n: p.detach().clone()
                for n, p in pl_module.named_parameters()
                if p.requires_grad and p.grad is not None and bool(p.grad.any())
            }

    def on_train_batch_end(
        self, trainer: "L.Trainer", pl_module: "L.LightningModule", outputs, batch, batch_idx: int
    ) -> None:
        if self._done:
            return
        self._done = True
        self._remove_hooks()
        params = dict(pl_module.named_parameters())
        frozen = [n for n, before in self._before.items() if torch.equal(params[n].detach(), before)]
        self._before = {}
        if frozen:
            _warn(
                f"{len(frozen)} parameters have gradients but did not change in the first optimizer step: "
                f"{', '.join(frozen[:5])}. They are probably missing from the optimizer (configure_optimizers) "
                "or their learning rate is 0."
            )
        trainer.callbacks = [c for c in trainer.callbacks if c is not self]

    def teardown(self, trainer: "L.Trainer", pl_module: "L.LightningModule", stage: str) -> None:
        self._remove_hooks()

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _tensors(inputs, prefix: str = ""):
    """(name, tensor) for every tensor in nested dicts, tuples and lists: positional inputs are named by index
    (`0`), keyword inputs by name (`lengths`), nested ones by their path (`0.x`)."""
    items = inputs.items() if isinstance(inputs, dict) else enumerate(inputs)
    for key, value in items:
        path = f"{prefix}{key}"
        if isinstance(value, Tensor):
            yield path, value
        elif isinstance(value, (dict, list, tuple)):
            yield from _tensors(value, f"{path}.")


def _warn(message: str) -> None:
    warnings.warn(message, PitfallWarning, stacklevel=2)

"""LeanHooks (opt-in, configs/fast_cpu.yaml): per-batch hooks that a callback does not implement are not called at
all, and two per-batch questions of Lightning's loop are answered once per fit."""

import os
from collections import OrderedDict
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn

# Lightning's private names this relies on: a release without them turns those speed-ups off (one warning), not
# the run.
try:
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
    from lightning.pytorch.trainer.connectors.data_connector import _DataHookSelector
    from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
except ImportError as err:  # pragma: no cover - depends on the installed Lightning
    _TrainingEpochLoop = _DataHookSelector = is_param_in_hook_signature = None
    PRIVATE_IMPORT_ERROR: str | None = str(err)
else:
    PRIVATE_IMPORT_ERROR = None

# The hooks Lightning calls once per batch (or per optimizer step); the others run once per epoch or less.
PER_BATCH_HOOKS = (
    "on_train_batch_start",
    "on_train_batch_end",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_test_batch_start",
    "on_test_batch_end",
    "on_predict_batch_start",
    "on_predict_batch_end",
)


class LeanHooks(Callback):
    """At setup, marks every callback's inherited no-op per-batch hooks as absent, answers two per-batch questions
    of Lightning's loop once for the whole fit, then leaves the callback list.

    Lightning calls each hook on every callback, whether the callback implements it or not: for each it formats
    the action name (reading `state_key`, which for a ModelCheckpoint builds the repr of a dict) and enters the
    profiler's context; with the default config's callbacks most per-step calls go to inherited no-ops.
    Lightning's dispatcher skips an attribute that is not callable, so an instance attribute `None` over an
    inherited no-op hook (Callback's own method) removes that call and its overhead; a hook the callback's class
    overrides is left alone, so nothing that runs changes.

    The two questions, asked again at every training batch though their answers cannot change during a fit:
    which object (module or data module) implements each of the three batch-transfer hooks (`is_overridden`
    pairs) and whether `training_step` takes `batch_idx` (an `inspect.getfullargspec`). The answers come from
    Lightning's own functions, once, at setup; they apply to the fit's loop and data hooks only
    (validate/test/predict attach theirs afresh). Both replace private Lightning methods on the instances, only
    where the classes are the ones this was written against (lightning 2.6); otherwise nothing is replaced, and
    one warning says so.

    And one environment variable: importing Lightning sets PYTORCH_NVML_BASED_CUDA_CHECK=1, which makes every
    `torch.cuda.is_available()` load the NVML library through ctypes, and torch's Adam/AdamW call it in every
    `step()` (their graph-capture check). Lightning sets it so that a check before a fork does not initialise
    CUDA in the parent (fork-started DDP, notebooks); by setup every process has been started and, on a GPU,
    has initialised CUDA already, so from here on the runtime's cached answer (the same one) is used:
    `runtime_cuda_check`.

    What each costs and saves: `make bench` (option fast_cpu) and docs/performance.md "Performance". Lightning has no switch
    for this; its profilers only add to the cost. It acts on the callbacks present at setup; callbacks added to
    `trainer.callbacks` later keep every hook.
    """

    def setup(self, trainer: "L.Trainer", pl_module: "L.LightningModule", stage: str) -> None:
        off = []  # the speed-ups this Lightning does not allow
        for callback in trainer.callbacks:
            skip_noop_hooks(callback)
        if stage == "fit":
            for name, speed_up in (
                ("batch-hook owners", lambda: cache_batch_hook_owners(trainer)),
                ("training_step kwargs", lambda: cache_training_step_kwargs(trainer, pl_module)),
            ):
                try:
                    done = PRIVATE_IMPORT_ERROR is None and speed_up()
                except Exception:  # noqa: BLE001 - an internal changed shape: leave Lightning's own code in place
                    done = False
                if not done:
                    off.append(name)
            runtime_cuda_check()
        if off:
            rank_zero_warn(
                f"LeanHooks: {', '.join(off)} left to Lightning (this lightning {L.__version__} does not have the "
                f"private names they were written against{': ' + PRIVATE_IMPORT_ERROR if PRIVATE_IMPORT_ERROR else ''}). "
                "Training is correct, only slower per step; drop configs/fast_cpu.yaml to silence this."
            )
        # A new list (Lightning iterates the one it read): removing from it during a hook would skip a callback.
        trainer.callbacks = [c for c in trainer.callbacks if c is not self]


def skip_noop_hooks(callback: Callback) -> list[str]:
    """Set each per-batch hook that `callback` inherits unchanged from Callback to None; return their names."""
    skipped = [h for h in PER_BATCH_HOOKS if getattr(type(callback), h, None) is getattr(Callback, h)]
    for hook in skipped:
        setattr(callback, hook, None)
    return skipped


def cache_batch_hook_owners(trainer: "L.Trainer") -> bool:
    """Answer `_DataHookSelector.get_instance` (module or data module, per batch-transfer hook) from a table built
    now with Lightning's own method; any other name still goes to it (and raises its error)."""
    selector = getattr(getattr(trainer, "_data_connector", None), "_datahook_selector", None)
    if _DataHookSelector is None or type(selector) is not _DataHookSelector:
        return False
    owners = {hook: selector.get_instance(hook) for hook in selector._valid_hooks}
    stock = selector.get_instance

    def get_instance(hook_name: str) -> Any:
        owner = owners.get(hook_name)
        return owner if owner is not None else stock(hook_name)

    selector.get_instance = get_instance
    return True


def cache_training_step_kwargs(trainer: "L.Trainer", pl_module: "L.LightningModule") -> bool:
    """The training loop's `_build_kwargs` with its `batch_idx` signature check done once for this module (the
    stock method for any other module a later fit of the same Trainer brings)."""
    loop = trainer.fit_loop.epoch_loop
    if _TrainingEpochLoop is None or type(loop) is not _TrainingEpochLoop:
        return False
    takes_batch_idx = is_param_in_hook_signature(pl_module.training_step, "batch_idx", min_args=2)

    def build_kwargs(kwargs: OrderedDict, batch: Any, batch_idx: int) -> OrderedDict:
        if trainer.lightning_module is not pl_module:
            return _TrainingEpochLoop._build_kwargs(loop, kwargs, batch, batch_idx)
        kwargs["batch"] = batch
        if takes_batch_idx:
            kwargs["batch_idx"] = batch_idx
        return kwargs

    loop._build_kwargs = build_kwargs
    return True


def runtime_cuda_check() -> None:
    """Let `torch.cuda.is_available()` use the CUDA runtime's cached answer instead of loading NVML at each call
    (LeanHooks' docstring): undo the PYTORCH_NVML_BASED_CUDA_CHECK=1 that importing Lightning set."""
    if os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK") == "1":
        os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "0"

"""LeanHooks: per-batch hooks that a callback does not implement are not called at all."""

import lightning as L
from lightning.pytorch.callbacks import Callback

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
    """At setup, marks every callback's inherited no-op per-batch hooks as absent, then leaves the callback list.

    Lightning calls each hook on every callback, whether the callback implements it or not: for each it formats
    the action name (reading `state_key`, which for a ModelCheckpoint builds the repr of a dict) and enters the
    profiler's context. With the default config's 11 callbacks and 6 hooks per training step that is 66 calls
    per step, 56 of them to inherited no-ops: timed alone, those 56 took ~0.8 ms per step on 2 CPU cores loaded
    by other jobs (~14 us each; 2026-12-01); end to end, `make bench` (options.no_lean_hooks, load ~1) ran the
    template at x0.94 of the default speed without it. Lightning's dispatcher skips an attribute that is not callable, so an
    instance attribute `None` over an inherited no-op hook (Callback's own method) removes that call and its
    overhead; a hook the callback's class overrides is left alone, so nothing that runs changes.

    Why not a stock feature: Lightning has no switch for this; its profilers only add to the cost.
    It acts on the callbacks present at setup; callbacks added to `trainer.callbacks` later keep every hook.
    """

    def setup(self, trainer: "L.Trainer", pl_module: "L.LightningModule", stage: str) -> None:
        for callback in trainer.callbacks:
            skip_noop_hooks(callback)
        # A new list (Lightning iterates the one it read): removing from it during a hook would skip a callback.
        trainer.callbacks = [c for c in trainer.callbacks if c is not self]


def skip_noop_hooks(callback: Callback) -> list[str]:
    """Set each per-batch hook that `callback` inherits unchanged from Callback to None; return their names."""
    skipped = [h for h in PER_BATCH_HOOKS if getattr(type(callback), h, None) is getattr(Callback, h)]
    for hook in skipped:
        setattr(callback, hook, None)
    return skipped

"""RNGState: puts every RNG stream into each checkpoint and restores it when training resumes."""

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback

from project.rng import capture_rng_states, restore_rng_states


class RNGState(Callback):
    """Saves python/numpy/torch/CUDA RNG states with every checkpoint; a resumed fit continues the streams.

    Lightning's stock features seed the streams (`seed_everything(workers=True)`) and isolate them
    (`isolate_rng`), but its checkpoints hold no RNG state, so a resumed run would draw other augmentations and
    dropout masks than the run it continues; its private `_collect_rng_states` (used only to hand states to
    spawned processes) returns NumPy's state as an ndarray tuple that `weights_only=True` loading refuses. Hence
    this callback, with project/rng.py's plain-type states.

    The states are restored in on_train_start, not when the checkpoint is loaded: between loading and the
    first training batch Lightning runs the sanity-check validation, which draws from the global RNG, and an
    uninterrupted run has no such draw at that point.
    """

    def __init__(self) -> None:
        self._to_restore: dict | None = None

    def state_dict(self) -> dict[str, Any]:
        return capture_rng_states()  # called while a checkpoint is written: the states at that moment

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._to_restore = state_dict

    def on_train_start(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        if self._to_restore is not None:
            restore_rng_states(self._to_restore)
            self._to_restore = None

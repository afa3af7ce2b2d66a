"""BestModelCheckpoint: a ModelCheckpoint that remembers the validation metrics of the checkpoint it selected."""

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor


class BestModelCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint (same arguments, same selection by `monitor` and `mode`), plus
    `best_model_metrics`: every logged `val/*` value of the epoch whose checkpoint is `best_model_path`.

    The checkpoint is selected by one metric (`monitor`, e.g. `val/loss`); `summary.json` also reports another one
    of that same epoch (`best_val_acc` = the selected checkpoint's `val/acc`). The values travel in this callback's
    state, so a resumed run still knows them. The stock ModelCheckpoint keeps only the monitored value of each
    top-k file (`best_k_models`, `best_model_score`); the epoch's other metrics are gone once the next epoch logs,
    and logging them into the file name would not survive a resume as data.

    It overrides two private ModelCheckpoint methods, `_update_best_and_save` (to see the epoch's metrics when a
    new top-k file is chosen) and `_save_checkpoint` (to record them before that file is written, so the file's
    own state holds them): Lightning offers no public hook there. pyproject.toml pins lightning below 2.7, and
    tests/test_checkpoint_rule.py checks the summary's `best_val_acc` that these methods feed after an upgrade.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.best_k_metrics: dict[str, dict[str, float]] = {}  # checkpoint path -> its val/* metrics
        self._pending: dict[str, float] | None = None

    @property
    def best_model_metrics(self) -> dict[str, float]:
        return self.best_k_metrics.get(self.best_model_path, {})

    def _update_best_and_save(
        self, current: Tensor, trainer: "L.Trainer", monitor_candidates: dict[str, Tensor]
    ) -> None:
        self._pending = {
            k: float(v)
            for k, v in monitor_candidates.items()
            if k.startswith("val/") and isinstance(v, Tensor) and v.numel() == 1
        }
        try:
            super()._update_best_and_save(current, trainer, monitor_candidates)
        finally:
            self._pending = None

    def _save_checkpoint(self, trainer: "L.Trainer", filepath: str) -> None:
        # The new top-k file: its metrics are recorded before it is written, so its own state holds them too.
        if self._pending is not None:
            self.best_k_metrics = {p: m for p, m in self.best_k_metrics.items() if p in self.best_k_models}
            self.best_k_metrics[filepath] = self._pending
        super()._save_checkpoint(trainer, filepath)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "best_k_metrics": dict(self.best_k_metrics)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.best_k_metrics = dict(state_dict.get("best_k_metrics", {}))

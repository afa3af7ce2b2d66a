"""RunSummary: writes `summary.json` in the run directory after fit, and again with test results."""

import json
import time
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from project.atomic import write_text_atomic
from project.callbacks.run_checkpoint import stage_metrics, staged
from project.rng import run_seed


class RunSummary(Callback):
    """Keeps the numbers a run is judged by in one small file, `<run dir>/summary.json`.

    Keys: best_val_acc and test_acc (fractions 0-1), best_checkpoint, last_checkpoint, monitor and best_score,
    epochs, global_step, seed (`seed_everything`'s value, see project.rng.run_seed), train_seconds (wall time of
    trainer.fit, validation included), plus every test metric (`test/acc` or `test_acc`: test_acc). The selection
    rule is the checkpoint callback's:
    `monitor` is its metric (configs/default.yaml: `val/loss`), `best_score` that metric's value at the selected
    checkpoint, and `best_val_acc` the `val/acc` of that same checkpoint (not the highest `val/acc` of the run).
    Without a monitored checkpoint callback the final weights are the ones tested: best_val_acc is then the last
    validation's `val/acc`.
    """

    def __init__(self) -> None:
        self.summary: dict = {}
        self._fit_start: float | None = None

    def path(self, trainer: "L.Trainer") -> Path:
        return Path(trainer.default_root_dir) / "summary.json"

    def on_fit_start(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        self._fit_start = time.perf_counter()

    def on_fit_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        ckpt = selecting_checkpoint(trainer)
        score = ckpt.best_model_score if ckpt is not None else None
        if ckpt is None:
            best_val_acc = stage_metrics(trainer.callback_metrics, "val").get("val/acc")
        elif staged(ckpt.monitor, "val") == "val/acc":
            best_val_acc = float(score) if score is not None else None
        else:  # RunCheckpoint remembers the selected epoch's val/* metrics; a plain ModelCheckpoint does not
            best_val_acc = getattr(ckpt, "best_model_metrics", {}).get("val/acc")
        self.summary.update(
            best_val_acc=best_val_acc,
            best_checkpoint=ckpt.best_model_path if ckpt else "",
            last_checkpoint=last_checkpoint(trainer),
            monitor=ckpt.monitor if ckpt else None,
            best_score=float(score) if score is not None else None,
            epochs=trainer.current_epoch,
            global_step=trainer.global_step,
            seed=run_seed(),
            train_seconds=round(time.perf_counter() - self._fit_start, 3) if self._fit_start else None,
        )
        self._write(trainer)

    def on_test_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        tested = stage_metrics(trainer.callback_metrics, "test")
        self.summary.update({k.replace("/", "_"): v for k, v in tested.items()})
        self._write(trainer)

    def _write(self, trainer: "L.Trainer") -> None:
        if trainer.is_global_zero and not trainer.sanity_checking:
            self.path(trainer).parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(self.path(trainer), json.dumps(self.summary, indent=2) + "\n")


def selecting_checkpoint(trainer: "L.Trainer") -> ModelCheckpoint | None:
    """The ModelCheckpoint that selects the best checkpoint: the first one with a `monitor`."""
    return next(
        (c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint) and c.monitor), None
    )


def last_checkpoint(trainer: "L.Trainer") -> str:
    return next(
        (
            c.last_model_path
            for c in trainer.checkpoint_callbacks
            if isinstance(c, ModelCheckpoint) and c.last_model_path
        ),
        "",
    )

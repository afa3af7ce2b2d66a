"""RunSummary: `summary.json` in the run directory after fit, and again with the test results."""

import json
import time
from pathlib import Path

from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from project.atomic import write_text_atomic
from project.callbacks.run_checkpoint import stage_metrics, staged
from project.rng import run_seed

FIRST = ("test_acc", "test_loss", "best_val_acc", "epochs", "train_seconds")  # the verdict, then the files


class RunSummary(Callback):
    """The numbers a run is judged by: `selected`'s, epochs, global_step, seed, train_seconds (of trainer.fit),
    and every test metric (`test/acc` or `test_acc`: test_acc), in the order a person reads them (FIRST)."""

    def __init__(self) -> None:
        self.summary, self._fit_start = {}, None

    def on_fit_start(self, trainer, pl_module) -> None:
        self._fit_start = time.perf_counter()

    def on_fit_end(self, trainer, pl_module) -> None:
        seconds = round(time.perf_counter() - self._fit_start, 3) if self._fit_start else None
        self.summary.update(
            **selected(trainer), epochs=trainer.current_epoch, global_step=trainer.global_step
        )
        self._write(trainer, seed=run_seed(), train_seconds=seconds)

    def on_test_end(self, trainer, pl_module) -> None:
        tested = stage_metrics(trainer.callback_metrics, "test")
        self._write(trainer, **{k.replace("/", "_"): v for k, v in tested.items()})

    def _write(self, trainer, **values) -> None:
        self.summary.update(values)
        self.summary = {**{k: self.summary[k] for k in FIRST if k in self.summary}, **self.summary}
        if trainer.is_global_zero and not trainer.sanity_checking:
            path = Path(trainer.default_root_dir) / "summary.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(path, json.dumps(self.summary, indent=2) + "\n")


def selected(trainer) -> dict:
    """best_val_acc, best_checkpoint, last_checkpoint, monitor and best_score of the first ModelCheckpoint with a
    `monitor`; best_val_acc is the selected epoch's val/acc (not the run's highest), else the last val/acc."""
    checkpoints = [c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)]
    last = next((c.last_model_path for c in checkpoints if c.last_model_path), "")
    ckpt = next((c for c in checkpoints if c.monitor), None)
    score = ckpt.best_model_score if ckpt is not None else None
    score = float(score) if score is not None else None
    if ckpt is None:
        acc = stage_metrics(trainer.callback_metrics, "val").get("val/acc")
    elif staged(ckpt.monitor, "val") == "val/acc":
        acc = score
    else:
        acc = getattr(ckpt, "best_model_metrics", {}).get("val/acc")
    best, monitor = (ckpt.best_model_path, ckpt.monitor) if ckpt else ("", None)
    return dict(
        best_val_acc=acc, best_checkpoint=best, last_checkpoint=last, monitor=monitor, best_score=score
    )

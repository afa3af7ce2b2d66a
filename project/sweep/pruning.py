"""TrialPruning: a sweep trial's process reports its epoch metric to the study and stops when the pruner says so.

Each trial is its own `python -m project fit` process, so the Optuna `Trial` object lives in the sweep worker,
not here. This callback rebuilds it from the study storage and the trial number (`optuna.trial.Trial(study,
trial_id)`, the id looked up by the storage's public get_trial_id_from_study_id_trial_number), then is
optuna-integration's PyTorchLightningPruningCallback unchanged: `trial.report` after every validation,
`trial.should_prune()` with the sweep's pruner. The sweep adds it to the trial's config; a normal run
never has it (best.yaml leaves it out).

A non-finite metric (a diverged trial) ends the process with exit code 1 and an `error:` line: the trial is FAILED,
not pruned. When a trial is pruned the process writes `pruned.json` into its run directory (the epoch and the value) and exits
with code 0 at once, without testing: the worker reads the file and marks the trial PRUNED. Under DDP
optuna-integration stops every rank together (RDB storage only, SQLite included) and the run then ends normally.
"""

import json
import math
import sys
from pathlib import Path

import optuna
from optuna_integration import PyTorchLightningPruningCallback

from project.atomic import write_text_atomic
from project.sweep.worker import PRUNED_FILE

DDP_PRUNED_KEY = "ddp_pl:pruned"  # optuna-integration's system attribute under DDP


class TrialPruning(PyTorchLightningPruningCallback):
    """Args: storage (URL, as the sweep's --storage), study_name, trial_number, monitor (the epoch metric), and
    space: the sweep file whose `pruner` decides (the sweep directory's copy)."""

    def __init__(self, storage: str, study_name: str, trial_number: int, monitor: str, space: str) -> None:
        from project.sweep.space import load_space
        from project.sweep.storage import open_storage

        opened = open_storage(storage, heartbeat=False)
        study = optuna.load_study(
            study_name=study_name, storage=opened, pruner=load_space(space).build_pruner()
        )
        study_id = opened.get_study_id_from_name(study_name)
        self._storage = opened
        self._trial_id = opened.get_trial_id_from_study_id_trial_number(study_id, trial_number)
        super().__init__(optuna.trial.Trial(study, self._trial_id), monitor)

    def on_validation_end(self, trainer, pl_module) -> None:
        value = trainer.callback_metrics.get(self.monitor)
        if not trainer.sanity_checking and value is not None and not math.isfinite(float(value)):
            # Optuna's pruners would prune a NaN; a diverged trial is a failure with its reason, not a pruned one.
            print(
                f"\nerror: {self.monitor} is {float(value)} after epoch {pl_module.current_epoch}: this trial "
                "diverged (a learning rate too high?). The sweep marks it failed and goes on.",
                file=sys.stderr,
                flush=True,
            )
            raise SystemExit(1)
        try:
            super().on_validation_end(trainer, pl_module)
        except optuna.TrialPruned as pruned:
            self._write(trainer, pl_module.current_epoch)
            print(f"\n{pruned} The sweep marks it pruned.", flush=True)
            raise SystemExit(0) from None  # Lightning tears down on any BaseException, then the process ends
        if self.is_ddp_backend and trainer.should_stop and trainer.is_global_zero:
            attrs = self._storage.get_trial_system_attrs(self._trial_id)
            if attrs.get(DDP_PRUNED_KEY):
                self._write(trainer, pl_module.current_epoch)

    def _write(self, trainer, epoch: int) -> None:
        value = trainer.callback_metrics.get(self.monitor)
        path = Path(trainer.default_root_dir) / PRUNED_FILE
        write_text_atomic(
            path, json.dumps({"epoch": epoch, self.monitor: float(value) if value is not None else None})
        )
        sys.stdout.flush()

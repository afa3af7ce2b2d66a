"""TrialPruning: in a sweep trial's process, reports its epoch metric to the study and stops when the pruner says so.

The sweep adds it to the trial's config (best.yaml leaves it out). Its own module: only a trial process imports
optuna-integration (and with it Lightning), not the sweep's workers.
"""

import math
import sys

import optuna
from optuna_integration import PyTorchLightningPruningCallback

from project.sweep.space import instantiate
from project.sweep.storage import open_storage
from project.sweep.worker import PRUNED_KEY


class TrialPruning(PyTorchLightningPruningCallback):
    """In a trial's process: optuna-integration's callback on the worker's trial, rebuilt from the storage and the
    trial number (the Optuna Trial object lives in the worker). A pruned trial is marked with PRUNED_KEY, as
    optuna-integration marks it under DDP, and its process ends at once without testing (exit code 0). A
    non-finite metric (a diverged trial) is a failure with its reason (exit code 1), not a pruned trial."""

    def __init__(
        self, storage: str, study_name: str, trial_number: int, monitor: str, pruner: dict | None
    ) -> None:
        opened = open_storage(storage, heartbeat=False)
        pruner = instantiate(pruner or {"class_path": "optuna.pruners.NopPruner"}, "pruner")
        study = optuna.load_study(study_name=study_name, storage=opened, pruner=pruner)
        study_id = opened.get_study_id_from_name(study_name)
        self._trial_id = opened.get_trial_id_from_study_id_trial_number(study_id, trial_number)
        super().__init__(optuna.trial.Trial(study, self._trial_id), monitor)

    def on_validation_end(self, trainer, pl_module) -> None:
        value = trainer.callback_metrics.get(self.monitor)
        if not trainer.sanity_checking and value is not None and not math.isfinite(float(value)):
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
            self._trial.storage.set_trial_system_attr(self._trial_id, PRUNED_KEY, True)
            print(f"\n{pruned} The sweep marks it pruned.", flush=True)
            raise SystemExit(0) from None  # Lightning tears down on any BaseException, then the process ends

"""TrialPruning, in a trial's process (the only one that imports optuna-integration and Lightning): the metric to the
study after every epoch, and a stop when the pruner says so."""

import math

import optuna
from optuna_integration import PyTorchLightningPruningCallback

from project.sweep.space import NO_PRUNER, instantiate
from project.sweep.storage import open_storage
from project.sweep.worker import PRUNED_KEY


class TrialPruning(PyTorchLightningPruningCallback):
    """optuna-integration's callback on the worker's trial, found by its number. Pruned: marked PRUNED_KEY, and the
    process ends without testing. A non-finite metric is a failure (exit code 1), not a pruned trial."""

    def __init__(self, storage: str, study_name: str, trial_number: int, monitor: str, pruner: dict | None):
        self.storage = open_storage(storage)
        pruner = instantiate(pruner or NO_PRUNER, "pruner")
        study = optuna.load_study(study_name=study_name, storage=self.storage, pruner=pruner)
        study_id = self.storage.get_study_id_from_name(study_name)
        self.trial_id = self.storage.get_trial_id_from_study_id_trial_number(study_id, trial_number)
        super().__init__(optuna.trial.Trial(study, self.trial_id), monitor)

    def on_validation_end(self, trainer, pl_module) -> None:
        value = trainer.callback_metrics.get(self.monitor)
        if not trainer.sanity_checking and value is not None and not math.isfinite(float(value)):
            raise SystemExit(
                f"\nerror: {self.monitor} is {float(value)} after epoch {pl_module.current_epoch}: this trial "
                "diverged (a learning rate too high?). The sweep marks it failed and goes on."
            )
        try:
            super().on_validation_end(trainer, pl_module)
        except optuna.TrialPruned as pruned:
            self.storage.set_trial_system_attr(self.trial_id, PRUNED_KEY, True)
            print(f"\n{pruned} The sweep marks it pruned.", flush=True)
            raise SystemExit(0) from None  # Lightning tears down on any BaseException

"""A sweep worker: trials of one study until it holds n_trials finished (complete or pruned) ones. Each trial is
its own `make train` process, so a NaN, an out-of-memory or a kill stays inside it, and a DDP trial has its ranks."""

import contextlib
import ctypes
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import optuna
import yaml
from optuna.trial import TrialState

from project.atomic import write_text_atomic
from project.sweep import storage
from project.sweep.space import SweepSpace

TRIAL_CONFIG, TRIAL_LOG = "sweep_trial.yaml", "console.log"
PRUNED_KEY = "ddp_pl:pruned"  # the system attribute optuna-integration sets when it prunes under DDP


class TrialFailed(RuntimeError): ...


def trial_dir(sweep_dir: Path, number: int) -> Path:
    return Path(sweep_dir, "trials", f"{number:03d}")


def fit_command(configs: list[str], overlay: Path, run_dir: Path) -> list[str]:
    bases = [arg for config in [*configs, str(overlay)] for arg in ("--config", config)]
    return [sys.executable, "-m", "project", "fit", *bases, "--run_dir", str(run_dir)]


def die_with_parent() -> None:
    """SIGTERM (a trial then saves last.ckpt) when the parent dies, even by kill -9 (Linux's PR_SET_PDEATHSIG)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))


@dataclass
class Sweep:
    space: SweepSpace
    sweep_dir: Path
    storage_url: str
    configs: list[str]
    metric: str
    n_trials: int
    max_failed: int  # failed trials of this command (numbered from first_trial on) that stop it
    first_trial: int = 0

    def objective(self, trial: optuna.Trial) -> float:
        params, study = self.space.sample(trial), trial.study
        run_dir = trial_dir(self.sweep_dir, trial.number)
        trial.set_user_attr("run_dir", str(run_dir))
        trial.set_user_attr("omp_num_threads", os.environ.get("OMP_NUM_THREADS"))  # for best.yaml's re-run
        trial.set_user_attr("pid", os.getpid())
        init = dict(storage=self.storage_url, study_name=study.study_name, trial_number=trial.number)
        pruning = {"class_path": "project.sweep.pruning.TrialPruning", "init_args": init}
        init.update(monitor=self.metric, pruner=self.space.pruner)
        overlay = {**self.space.fixed, **params, "trainer.callbacks+": [pruning]}  # dotted keys, as flags
        run_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(run_dir / TRIAL_CONFIG, yaml.safe_dump(overlay, sort_keys=False))
        print(f"Trial {trial.number}: {run_dir} ({TRIAL_LOG} there)", flush=True)
        command, log = fit_command(self.configs, run_dir / TRIAL_CONFIG, run_dir), run_dir / TRIAL_LOG
        with open(log, "ab") as out:
            process = subprocess.Popen(command, stdout=out, stderr=out, preexec_fn=die_with_parent)
            try:
                code = process.wait()
            except BaseException:  # Ctrl+C or SIGTERM of the worker: the trial saves last.ckpt and exits
                process.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=60)
                process.kill()
                storage.requeue_dead_trial(study, study.get_trials(deepcopy=False)[trial.number])
                raise
        frozen = study.get_trials(deepcopy=False)[trial.number]
        if frozen.system_attrs.get(PRUNED_KEY):
            raise optuna.TrialPruned(f"pruned after epoch {max(frozen.intermediate_values, default=0)}")
        value = read_metric(run_dir, frozen, self.metric, study.direction) if code == 0 else None
        if value is not None and math.isfinite(value):
            return value
        error = f"exit code {code}: {last_lines(log)}" if code else f"{self.metric} is {value}"
        trial.set_user_attr("error", error)
        raise TrialFailed(f"{error} (full log: {log})")


def run_worker(sweep: Sweep, study: optuna.Study) -> int:
    """Trials until the study holds n_trials finished ones; 1 when max_failed trials of this command failed."""
    while True:
        optuna.storages.fail_stale_trials(study)  # dead workers' trials: failed, their values queued again
        trials = study.get_trials(deepcopy=False)
        finished = sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials)
        running = sum(t.state == TrialState.RUNNING for t in trials)
        mine = trials[sweep.first_trial :]  # a trial's own failures, not a stopped or dead worker's
        failed = sum(t.state == TrialState.FAIL and "error" in t.user_attrs for t in mine)
        if finished >= sweep.n_trials:
            return 0
        if failed >= sweep.max_failed:
            why = f"{failed} trials of this command failed (--max_failed {sweep.max_failed}); the sweep stops: each trial's console.log under {sweep.sweep_dir}/trials/ says why"
            print(f"error: {why}.", file=sys.stderr)
            return 1
        if finished + running >= sweep.n_trials:  # until a running trial ends, or goes stale
            time.sleep(storage.HEARTBEAT_INTERVAL_S)
        else:
            study.optimize(sweep.objective, n_trials=1, catch=(TrialFailed,))


def read_metric(run_dir: Path, trial: optuna.trial.FrozenTrial, metric: str, direction) -> float | None:
    """The monitor's best_score from summary.json, else the best value the trial reported (under DDP as well)."""
    path = run_dir / "summary.json"
    summary = json.loads(path.read_text()) if path.exists() else {}
    if summary.get("monitor") == metric:
        return None if summary.get("best_score") is None else float(summary["best_score"])
    values = trial.intermediate_values or trial.system_attrs.get("ddp_pl:intermediate_value") or {}
    return (min if direction == optuna.study.StudyDirection.MINIMIZE else max)(values.values(), default=None)


def last_lines(log: Path, n: int = 6) -> str:
    """The CLI's one-paragraph error (`error: ...`) from a process's console output, else its last lines."""
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return f"(no {log.name})"
    errors = [i for i, line in enumerate(lines) if line.startswith("error:")]
    return (" ".join(lines[errors[-1] : errors[-1] + n]) if errors else " | ".join(lines[-n:]))[:2000]

"""A sweep worker: runs trials of one study until it holds n_trials finished ones (complete or pruned).

Each trial is its own process, `make train` with one more --config overlay, so a NaN, an out-of-memory or a kill
stays inside it, and a DDP trial launches its own ranks. Pruned (project/sweep/pruning.py) -> PRUNED; exit 0 ->
COMPLETE; another exit or a non-finite metric -> FAIL with the error's last lines in its user attribute `error`.
"""

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
from project.sweep.space import SweepSpace, nest
from project.sweep.storage import HEARTBEAT_INTERVAL_S

TRIAL_CONFIG, TRIAL_LOG = "sweep_trial.yaml", "console.log"
PRUNED_KEY = "ddp_pl:pruned"  # the trial's system attribute optuna-integration sets when it prunes under DDP


class TrialFailed(RuntimeError):
    """A trial's process failed or gave no usable metric; Optuna records the trial as FAIL and the sweep goes on."""


@dataclass
class Sweep:
    space: SweepSpace
    sweep_dir: Path
    storage_url: str
    configs: list[str]
    fixed: dict
    metric: str
    n_trials: int
    max_failed: int  # failed trials of this command (numbered from first_trial on) that stop it
    first_trial: int = 0


def trial_dir(sweep_dir: Path, number: int) -> Path:
    return Path(sweep_dir) / "trials" / f"{number:03d}"


def fit_command(configs: list[str], overlay: Path, run_dir: Path) -> list[str]:
    bases = [arg for config in [*configs, str(overlay)] for arg in ("--config", config)]
    return [sys.executable, "-m", "project", "fit", *bases, "--run_dir", str(run_dir)]


def die_with_parent() -> None:
    """In a child process: SIGTERM when its parent dies, even by kill -9 (Linux prctl PR_SET_PDEATHSIG); a trial
    then saves last.ckpt and exits. Elsewhere the child runs to its end."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))
    except (OSError, AttributeError):
        pass


def make_objective(sweep: Sweep, study: optuna.Study):
    def objective(trial: optuna.Trial) -> float:
        params = sweep.space.sample(trial)
        run_dir = trial_dir(sweep.sweep_dir, trial.number)
        trial.set_user_attr("run_dir", str(run_dir))
        trial.set_user_attr("omp_num_threads", os.environ.get("OMP_NUM_THREADS"))  # for best.yaml's re-run
        trial.set_user_attr("pid", os.getpid())  # the worker's
        init = dict(storage=sweep.storage_url, study_name=study.study_name, trial_number=trial.number)
        pruning = {"class_path": "project.sweep.pruning.TrialPruning", "init_args": init}
        init.update(monitor=sweep.metric, pruner=sweep.space.pruner)
        overlay = nest({**sweep.fixed, **params})
        overlay.setdefault("trainer", {})["callbacks+"] = [pruning]  # appended to the base config's callbacks
        run_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(run_dir / TRIAL_CONFIG, yaml.safe_dump(overlay, sort_keys=False))
        print(f"Trial {trial.number}: {run_dir} ({TRIAL_LOG} there)", flush=True)
        command, log = fit_command(sweep.configs, run_dir / TRIAL_CONFIG, run_dir), run_dir / TRIAL_LOG
        with open(log, "ab") as out:
            process = subprocess.Popen(command, stdout=out, stderr=out, preexec_fn=die_with_parent)
            try:
                code = process.wait()
            except BaseException:  # Ctrl+C or SIGTERM of the worker: stop the trial, run its values later
                process.terminate()  # the trial saves last.ckpt and exits 143
                try:
                    process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    process.kill()
                base = {"base_config": True} if trial.user_attrs.get("base_config") else {}  # no retry limit
                study.enqueue_trial(params, user_attrs={"retry_of": trial.number, **base})
                raise
        frozen = study.get_trials(deepcopy=False)[trial.number]
        if frozen.system_attrs.get(PRUNED_KEY):
            raise optuna.TrialPruned(f"pruned after epoch {max(frozen.intermediate_values, default=0)}")
        value = read_metric(run_dir, frozen, sweep.metric, study.direction) if code == 0 else None
        if value is not None and math.isfinite(value):
            return value
        error = f"exit code {code}: {last_lines(log)}" if code else f"{sweep.metric} is {value}"
        trial.set_user_attr("error", error)
        raise TrialFailed(f"{error} (full log: {log})")

    return objective


def read_metric(run_dir: Path, trial: optuna.trial.FrozenTrial, metric: str, direction) -> float | None:
    """The checkpoint monitor's best_score from summary.json; another metric's best value the trial reported
    (optuna-integration keeps them in a system attribute under DDP)."""
    path = run_dir / "summary.json"
    summary = json.loads(path.read_text()) if path.exists() else {}
    if summary.get("monitor") == metric:
        return None if summary.get("best_score") is None else float(summary["best_score"])
    values = trial.intermediate_values or trial.system_attrs.get("ddp_pl:intermediate_value") or {}
    better = min if direction == optuna.study.StudyDirection.MINIMIZE else max
    return better(values.values()) if values else None


def last_lines(log: Path, n: int = 6) -> str:
    """The end of a process's console output: the CLI's one-paragraph error (`error: ...`) or the last lines."""
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return f"(no {log.name})"
    errors = [i for i, line in enumerate(lines) if line.startswith("error:")]
    return (" ".join(lines[errors[-1] : errors[-1] + n]) if errors else " | ".join(lines[-n:]))[:2000]


def run_worker(sweep: Sweep, study: optuna.Study) -> int:
    """Trials until n_trials are finished (complete or pruned) across all workers. Exit code: 0, or 1 when
    max_failed trials have failed (every trial failing means a config error: see a trial's console.log)."""
    objective = make_objective(sweep, study)
    while True:
        optuna.storages.fail_stale_trials(study)  # dead workers' trials: failed, their values queued again
        trials = study.get_trials(deepcopy=False)
        finished = sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials)
        running = sum(t.state == TrialState.RUNNING for t in trials)
        # failures of the trials themselves in this command (a stopped or dead worker's trial runs again instead)
        mine = trials[sweep.first_trial :]
        failed = sum(t.state == TrialState.FAIL and "error" in t.user_attrs for t in mine)
        # A running trial finishes, or fails and its worker runs another, or goes stale when its worker died: on
        # the journal, which has no heartbeat, it might stay RUNNING for ever.
        busy = finished + running >= sweep.n_trials
        if finished >= sweep.n_trials or busy and sweep.storage_url.startswith("journal:"):
            return 0
        if failed >= sweep.max_failed:
            failures = f"{failed} trials of this command failed (--max_failed {sweep.max_failed})"
            where = f"each trial's console.log under {sweep.sweep_dir}/trials/ says why"
            print(f"error: {failures}; the sweep stops: {where}.", file=sys.stderr)
            return 1
        if busy:
            time.sleep(HEARTBEAT_INTERVAL_S)
        else:
            study.optimize(objective, n_trials=1, catch=(TrialFailed,))

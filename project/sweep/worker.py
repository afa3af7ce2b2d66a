"""A sweep worker: runs trials of one study until it holds n_trials finished ones (complete or pruned).

Each trial is its own process, `python -m project fit --config <base> --config <trial dir>/sweep_trial.yaml
--run_dir <sweep>/trials/<n>`: exactly `make train` with one more overlay, so a NaN, an out-of-memory or a kill
stays inside that trial, and a DDP trial launches its own ranks, not copies of the sweep. What it prints goes
to `console.log` in its run directory.

Outcomes: pruned (project/sweep/pruning.py) -> PRUNED; exit 0 -> COMPLETE with the metric; any other exit or a
non-finite metric -> FAIL with the error's last lines in the trial's user attribute `error`, and the sweep goes on.
"""

import ctypes
import json
import math
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import optuna
import yaml
from optuna.trial import TrialState

from project.atomic import write_text_atomic
from project.sweep.space import SweepSpace, nest
from project.sweep.storage import recover_dead_trials

TRIAL_CONFIG, TRIAL_LOG = "sweep_trial.yaml", "console.log"
PRUNED_KEY = "ddp_pl:pruned"  # the trial's system attribute optuna-integration sets when it prunes under DDP
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)


class TrialFailed(RuntimeError):
    """A trial's process failed or gave no usable metric; Optuna records the trial as FAIL and the sweep goes on."""


@dataclass
class Sweep:
    space: SweepSpace
    sweep_dir: Path
    storage_url: str
    study_name: str
    configs: list[str]
    fixed: dict
    metric: str
    n_trials: int
    max_failed: int  # failed trials of this command (numbered from first_trial on) that stop it
    first_trial: int = 0
    threads: str | None = None  # OMP_NUM_THREADS of the trial processes (None: inherited / torch's default)


def trial_dir(sweep_dir: Path, number: int) -> Path:
    return Path(sweep_dir) / "trials" / f"{number:03d}"


def fit_command(configs: list[str], overlay: Path, run_dir: Path) -> list[str]:
    bases = [arg for config in configs for arg in ("--config", config)]
    return [
        sys.executable,
        "-m",
        "project",
        "fit",
        *bases,
        "--config",
        str(overlay),
        "--run_dir",
        str(run_dir),
    ]


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
        run_dir.mkdir(parents=True, exist_ok=True)
        threads = sweep.threads or os.environ.get("OMP_NUM_THREADS")
        # The pid last: recover_dead_trials judges a RUNNING trial by its host and pid, and a re-queued trial
        # starts without either.
        for key, value in (
            ("run_dir", str(run_dir)),
            ("omp_num_threads", threads),
            ("host", socket.gethostname()),
        ):
            trial.set_user_attr(key, value)
        trial.set_user_attr("pid", os.getpid())
        init = dict(storage=sweep.storage_url, study_name=sweep.study_name, trial_number=trial.number)
        init.update(monitor=sweep.metric, pruner=sweep.space.pruner)
        pruning = {"class_path": "project.sweep.pruning.TrialPruning", "init_args": init}
        overlay = nest({**sweep.fixed, **params})
        overlay.setdefault("trainer", {})["callbacks+"] = [pruning]  # appended to the base config's callbacks
        config = run_dir / TRIAL_CONFIG
        write_text_atomic(config, yaml.safe_dump(overlay, sort_keys=False))
        print(f"Trial {trial.number}: {run_dir} ({TRIAL_LOG} there)", flush=True)
        env = dict(os.environ, **({"OMP_NUM_THREADS": sweep.threads} if sweep.threads else {}))
        with open(run_dir / TRIAL_LOG, "ab") as log:
            process = subprocess.Popen(
                fit_command(sweep.configs, config, run_dir),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=die_with_parent,
            )
            try:
                code = process.wait()
            except (
                BaseException
            ):  # Ctrl+C / SIGTERM of the worker: stop the trial, run its values again later
                stop_process(process)
                base = {"base_config": True} if trial.user_attrs.get("base_config") else {}  # no retry limit
                study.enqueue_trial(params, user_attrs={"retry_of": trial.number, **base})
                raise
        frozen = study.get_trials(deepcopy=False)[trial.number]
        if frozen.system_attrs.get(PRUNED_KEY):
            raise optuna.TrialPruned(f"pruned after epoch {max(frozen.intermediate_values, default=0)}")
        value = read_metric(run_dir, frozen, sweep.metric, study.direction) if code == 0 else None
        if value is not None and math.isfinite(value):
            return value
        error = (
            f"exit code {code}: {last_lines(run_dir / TRIAL_LOG)}" if code else f"{sweep.metric} is {value}"
        )
        trial.set_user_attr("error", error)
        raise TrialFailed(f"{error} (full log: {run_dir / TRIAL_LOG})")

    return objective


def stop_process(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)  # the trial saves last.ckpt and exits 143
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def read_metric(run_dir: Path, trial: optuna.trial.FrozenTrial, metric: str, direction) -> float | None:
    """The checkpoint monitor's best_score from summary.json; another metric's best value the trial reported
    (optuna-integration keeps them in a system attribute under DDP)."""
    summary = run_dir / "summary.json"
    summary = json.loads(summary.read_text()) if summary.exists() else {}
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
        recover_dead_trials(study)
        trials = study.get_trials(deepcopy=False)
        # a failure of the trial itself, in this command (a stopped or dead worker's trial runs again instead)
        failed = sum(
            t.state == TrialState.FAIL and "error" in t.user_attrs for t in trials[sweep.first_trial :]
        )
        if sum(t.state in (*FINISHED, TrialState.RUNNING) for t in trials) >= sweep.n_trials:
            return 0  # a running trial that then fails is replaced by its own worker
        if failed >= sweep.max_failed:
            print(
                f"error: {failed} trials of this command failed (--max_failed {sweep.max_failed}); the sweep "
                f"stops. Each trial's console.log under {sweep.sweep_dir}/trials/ says why.",
                file=sys.stderr,
                flush=True,
            )
            return 1
        study.optimize(objective, n_trials=1, catch=(TrialFailed,))

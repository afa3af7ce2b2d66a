"""A sweep worker: runs trials of one study until it holds n_trials finished ones (complete or pruned).

Each trial is its own process, `python -m project fit --config <base> --config <trial dir>/sweep_trial.yaml
--run_dir <sweep>/trials/<n>`: exactly `make train` with one more overlay, so a NaN, an out-of-memory or a kill
stays inside that trial, and a DDP trial launches its own ranks, not copies of the sweep. The trial's run
directory is a normal one (config.yaml, logs, checkpoints, summary.json) plus `console.log` (what it printed) and
`sweep_trial.yaml`.

Outcomes: exit 0 with summary.json -> COMPLETE with the metric; `pruned.json` written -> PRUNED; any other exit
or a non-finite metric -> FAIL with the error's last lines in the trial's user attribute `error`, and the sweep
goes on. A worker that dies (kill -9, a lost machine) leaves its trial RUNNING: the next worker to start a trial
marks it FAIL and re-queues its parameters (Optuna's RetryHeartbeatStaleTrialCallback), at once when the dead worker ran
on this machine (its process id is gone), after the heartbeat's grace period otherwise. A live trial is never
touched: its worker's heartbeat is fresh and its process exists.
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
from optuna.study import MaxTrialsCallback
from optuna.trial import TrialState

from project.atomic import write_text_atomic
from project.sweep.space import SweepSpace, nest
from project.sweep.storage import requeue_dead_trial

TRIAL_CONFIG = "sweep_trial.yaml"
PRUNED_FILE = "pruned.json"  # written by the trial process (project/sweep/pruning.py) when it is pruned
TRIAL_LOG = "console.log"
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)


class TrialFailed(RuntimeError):
    """A trial's process failed or gave no usable metric; Optuna records the trial as FAIL and the sweep goes on."""


@dataclass
class Sweep:
    space: SweepSpace
    space_copy: (
        Path  # the sweep directory's copy of the sweep file (trial processes build the pruner from it)
    )
    sweep_dir: Path
    storage_url: str
    study_name: str
    configs: list[str]
    fixed: dict
    metric: str
    monitor: str  # the base config's checkpoint monitor (summary.json best_score)
    direction: str
    n_trials: int
    max_failed: int  # failed trials this command stops at: --max_failed plus the failures before it
    threads: str | None  # OMP_NUM_THREADS of the trial processes (None: inherited / torch's default)
    failed_before: int = 0  # failed trials from earlier commands, which --max_failed does not count


def trial_dir(sweep_dir: Path, number: int) -> Path:
    return Path(sweep_dir) / "trials" / f"{number:03d}"


def trial_config(sweep: Sweep, params: dict, number: int) -> dict:
    overlay = nest({**sweep.fixed, **params})
    pruning = {
        "class_path": "project.sweep.pruning.TrialPruning",
        "init_args": {
            "storage": sweep.storage_url,
            "study_name": sweep.study_name,
            "trial_number": number,
            "monitor": sweep.metric,
            "space": str(sweep.space_copy),
        },
    }
    overlay.setdefault("trainer", {})["callbacks+"] = [pruning]  # appended to the base config's callbacks
    return overlay


def trial_command(sweep: Sweep, config: Path, run_dir: Path) -> list[str]:
    command = [sys.executable, "-m", "project", "fit"]
    for base in sweep.configs:
        command += ["--config", base]
    return command + ["--config", str(config), "--run_dir", str(run_dir)]


def trial_env(sweep: Sweep) -> dict:
    env = dict(os.environ)
    if sweep.threads:
        env["OMP_NUM_THREADS"] = sweep.threads
    return env


def die_with_parent() -> None:
    """In the trial process: SIGTERM when the worker dies, even by kill -9 (Linux prctl PR_SET_PDEATHSIG); the
    trial's GracefulStop then saves last.ckpt and exits. Elsewhere the trial runs to its end, unreported."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))
    except (OSError, AttributeError):
        pass


def make_objective(sweep: Sweep, study: optuna.Study):
    def objective(trial: optuna.Trial) -> float:
        params = sweep.space.sample(trial)
        run_dir = trial_dir(sweep.sweep_dir, trial.number)
        run_dir.mkdir(parents=True, exist_ok=True)
        # The owner last, pid after host: recover_dead_trials judges a RUNNING trial by its host and pid, and a
        # re-queued trial starts without either (project/sweep/storage.py: requeue_dead_trial).
        for key, value in (
            ("run_dir", str(run_dir)),
            ("omp_num_threads", sweep.threads or os.environ.get("OMP_NUM_THREADS")),
            ("host", socket.gethostname()),
            ("pid", os.getpid()),
        ):
            trial.set_user_attr(key, value)
        config = run_dir / TRIAL_CONFIG
        write_text_atomic(config, yaml.safe_dump(trial_config(sweep, params, trial.number), sort_keys=False))
        (run_dir / PRUNED_FILE).unlink(missing_ok=True)
        print(f"Trial {trial.number}: {run_dir} ({TRIAL_LOG} there)", flush=True)
        with open(run_dir / TRIAL_LOG, "ab") as log:
            process = subprocess.Popen(
                trial_command(sweep, config, run_dir),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=trial_env(sweep),
                preexec_fn=die_with_parent if sys.platform.startswith("linux") else None,
            )
            try:
                code = process.wait()
            except (
                BaseException
            ):  # Ctrl+C / SIGTERM of the worker: stop the trial, run its values again later
                stop_process(process)
                retry = {"retry_of": trial.number}
                if trial.user_attrs.get("base_config"):
                    retry["base_config"] = True  # still the base config's trial: retried without limit
                study.enqueue_trial(params, user_attrs=retry)
                raise
        return trial_result(sweep, trial, run_dir, code)

    return objective


def stop_process(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)  # the trial saves last.ckpt and exits 143
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def trial_result(sweep: Sweep, trial: optuna.Trial, run_dir: Path, code: int) -> float:
    pruned = run_dir / PRUNED_FILE
    if pruned.exists():
        raise optuna.TrialPruned(f"pruned after epoch {json.loads(pruned.read_text()).get('epoch')}")
    if code != 0:
        error = f"exit code {code}: {last_lines(run_dir / TRIAL_LOG)}"
        trial.set_user_attr("error", error)
        raise TrialFailed(f"{error} (full log: {run_dir / TRIAL_LOG})")
    value = read_metric(run_dir, sweep.metric, sweep.monitor, sweep.direction)
    if value is None or not math.isfinite(value):
        error = f"{sweep.metric} is {value} in {run_dir}"
        trial.set_user_attr("error", error)
        raise TrialFailed(error)
    return value


def read_metric(run_dir: Path, metric: str, monitor: str, direction: str) -> float | None:
    """The checkpoint monitor's best_score from summary.json; another metric's best epoch value from metrics.csv."""
    summary_path = run_dir / "summary.json"
    if metric == monitor and summary_path.exists():
        score = json.loads(summary_path.read_text()).get("best_score")
        return float(score) if score is not None else None
    import csv

    values = []
    for path in sorted(run_dir.glob("metrics*.csv")):
        with open(path, newline="") as handle:
            values += [float(row[metric]) for row in csv.DictReader(handle) if row.get(metric)]
    if not values:
        return None
    return min(values) if direction == "minimize" else max(values)


def last_lines(log: Path, n: int = 6) -> str:
    """The end of a trial's console output: the error paragraph or the exception line."""
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "(no console.log)"
    for i in range(len(lines) - 1, -1, -1):  # the CLI's one-paragraph errors start with "error:"
        if lines[i].startswith("error:"):
            return " ".join(lines[i : i + n])[:2000]
    return " | ".join(lines[-n:])[:2000]


def process_alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, TypeError, ValueError):
        return True
    try:  # a killed worker not yet reaped by its parent is a zombie: dead
        return Path(f"/proc/{int(pid)}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def recover_dead_trials(study: optuna.Study) -> None:
    """RUNNING trials whose worker ran on this machine and is gone: FAIL, and their parameters re-queued.

    Once per dead trial, also when workers resuming together all see it RUNNING: the first to mark it failed queues
    it again, the others find it finished (`_fail_and_requeue`). On SQLite that holds because every transaction
    takes the write lock when it begins (project/sweep/storage.py, serialize_sqlite_transactions); before, two
    workers both marked it failed, and the extra copy of its parameters waited forever once n_trials were finished.
    """
    host = socket.gethostname()
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        pid = trial.user_attrs.get("pid")
        if trial.user_attrs.get("host") == host and pid is not None and not process_alive(pid):
            _fail_and_requeue(study, trial, host)


def _fail_and_requeue(study: optuna.Study, trial: optuna.trial.FrozenTrial, host: str) -> None:
    pid = trial.user_attrs["pid"]
    try:
        study.tell(trial.number, state=TrialState.FAIL)
    except (RuntimeError, ValueError):
        return  # another worker got there first
    failed = next(t for t in study.get_trials(deepcopy=True) if t.number == trial.number)
    study.set_user_attr(f"dead_worker_{trial.number}", f"pid {pid} on {host}")
    requeue_dead_trial(study, failed)
    print(
        f"Trial {trial.number}: its worker (pid {pid}) is gone; marked failed, parameters re-queued.",
        flush=True,
    )


def run_worker(sweep: Sweep, study: optuna.Study) -> int:
    """Trials until n_trials are finished (complete or pruned) across all workers. Exit code: 0, or 1 when
    max_failed trials have failed (every trial failing means a config error: see a trial's console.log)."""
    objective = make_objective(sweep, study)
    enough = MaxTrialsCallback(
        sweep.n_trials, states=FINISHED
    )  # stops this worker when others finished the count
    while True:
        recover_dead_trials(study)
        trials = study.get_trials(deepcopy=False)
        finished = sum(t.state in FINISHED for t in trials)
        running = sum(t.state == TrialState.RUNNING for t in trials)
        # failures of the trial itself (an error recorded); stopped and dead workers' trials run again instead
        failed = sum(t.state == TrialState.FAIL and "error" in t.user_attrs for t in trials)
        if finished + running >= sweep.n_trials:
            return 0  # a running trial that then fails is replaced by its own worker
        if failed >= sweep.max_failed:
            before = f", besides {sweep.failed_before} from earlier runs" if sweep.failed_before else ""
            print(
                f"error: {failed - sweep.failed_before} trials failed (--max_failed "
                f"{sweep.max_failed - sweep.failed_before}{before}); the sweep stops. Each "
                f"trial's console.log under {sweep.sweep_dir}/trials/ says why.",
                file=sys.stderr,
                flush=True,
            )
            return 1
        study.optimize(objective, n_trials=1, catch=(TrialFailed,), callbacks=[enough])

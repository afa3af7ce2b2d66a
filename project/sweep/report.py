"""A sweep's results: trials.csv and a console table, best.yaml (re-runnable with `make train`), report.png.

The PNG is drawn here with matplotlib (history + importances side by side in one figure): Optuna's
`optuna.visualization.matplotlib.plot_*` functions each draw their own figure and are marked experimental, and
the plotly versions need plotly and a browser or kaleido to become a PNG. The importances are Optuna's
(`optuna.importance.get_param_importances`, its default PED-ANOVA evaluator).
"""

import csv
import os
import shlex
import sys
import warnings
from pathlib import Path

import optuna
import yaml
from optuna.trial import TrialState

from project.atomic import atomic_write, write_text_atomic
from project.sweep.worker import TRIAL_CONFIG, trial_dir

DEFAULT_CONFIG = "configs/default.yaml"


def write_report(study: optuna.Study, sweep_dir: Path, configs: list[str], metric: str) -> Path | None:
    """Write trials.csv, best.yaml and report.png into the sweep directory, print the table; best.yaml's path."""
    sweep_dir = Path(sweep_dir)
    trials = study.get_trials(deepcopy=False)
    keys = sorted({k for t in trials for k in t.params})
    rows = [row(t, keys) for t in trials]
    with atomic_write(sweep_dir / "trials.csv", newline="") as handle:  # several workers may report at once
        write_csv(handle, rows)
    print_table(study, rows, keys, metric)
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    if not complete:
        print("No complete trial yet: no best.yaml.", flush=True)
        return None
    best = study.best_trial
    best_path = sweep_dir / "best.yaml"
    write_text_atomic(
        best_path, best_yaml(best, sweep_dir, configs, metric, study.direction, study.study_name)
    )
    try:
        plot(study, sweep_dir / "report.png", metric)
    except Exception as err:  # a plot must not cost the sweep its results
        print(f"report.png not written: {err}", flush=True)
    print(
        f"Best: trial {best.number}, {metric} = {best.value:.6g}. Re-run it: {rerun_command(best_path, configs)}"
    )
    print(f"Sweep directory: {sweep_dir}", flush=True)
    return best_path


def row(trial, keys: list[str]) -> dict:
    duration = trial.duration.total_seconds() if trial.duration else None
    return {
        "number": trial.number,
        "state": trial.state.name,
        "value": trial.value if trial.value is not None else "",
        **{k: trial.params.get(k, "") for k in keys},
        "last_epoch": max(trial.intermediate_values) if trial.intermediate_values else "",
        "seconds": round(duration, 1) if duration is not None else "",
        "run_dir": trial.user_attrs.get("run_dir", ""),
        "error": trial.user_attrs.get("error", ""),
    }


def write_csv(handle, rows: list[dict]) -> None:
    if rows:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def print_table(study: optuna.Study, rows: list[dict], keys: list[str], metric: str) -> None:
    from rich.console import Console
    from rich.table import Table

    best = study.best_trial.number if any(r["state"] == "COMPLETE" for r in rows) else None
    table = Table(title=f"Sweep '{study.study_name}': {metric} ({study.direction.name.lower()})")
    for column in ["#", "state", metric, *[k.rsplit(".", 1)[-1] for k in keys], "epochs", "s"]:
        table.add_column(column, no_wrap=True)
    table.add_column("error", overflow="ellipsis", no_wrap=True, max_width=60)
    for r in rows:
        table.add_row(
            f"{r['number']}{' *' if r['number'] == best else ''}",
            r["state"],
            fmt(r["value"]),
            *[fmt(r[k]) for k in keys],
            str(r["last_epoch"] + 1 if r["last_epoch"] != "" else ""),
            str(r["seconds"]),
            str(r["error"]),
        )
    # Piped or in a log file Rich would assume 80 columns and cut every column short: the CSV has it all, but the
    # log should too.
    Console(width=None if sys.stdout.isatty() else 200).print(table)


def fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def best_yaml(best, sweep_dir: Path, configs: list[str], metric: str, direction, study_name: str) -> str:
    """The best trial's own overlay (fixed keys + its parameters) without the sweep's pruning callback."""
    overlay = yaml.safe_load((trial_dir(sweep_dir, best.number) / TRIAL_CONFIG).read_text())
    trainer = overlay.get("trainer", {})
    trainer.pop("callbacks+", None)
    if not trainer:
        overlay.pop("trainer", None)
    threads = best.user_attrs.get("omp_num_threads")
    path = sweep_dir / "best.yaml"
    header = [
        f"# Best trial of sweep '{study_name}': trial {best.number}, {metric} = {best.value!r} "
        f"({direction.name.lower()}), run {best.user_attrs.get('run_dir', '')}",
        f"# Re-run: {rerun_command(path, configs)}",
        "# The same metric, bit for bit, needs the same machine, seed and thread count: the trial ran with "
        + (
            f"OMP_NUM_THREADS={threads}."
            if threads
            else "torch's default thread count (OMP_NUM_THREADS unset)."
        ),
    ]
    return "\n".join(header) + "\n" + yaml.safe_dump(overlay, sort_keys=False)


def rerun_command(best_path: Path, configs: list[str]) -> str:
    if [os.path.normpath(c) for c in configs] == [os.path.normpath(DEFAULT_CONFIG)]:
        return f'make train ARGS="--config {best_path}"'
    flags = " ".join(f"--config {shlex.quote(c)}" for c in [*configs, str(best_path)])
    return f"python -m project fit {flags}"


def plot(study: optuna.Study, path: Path, metric: str) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    complete = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
    figure, (history, importance) = plt.subplots(1, 2, figsize=(12, 4.5))
    numbers = [t.number for t in complete]
    values = [t.value for t in complete]
    history.scatter(numbers, values, s=18, label="trial")
    better = min if study.direction == optuna.study.StudyDirection.MINIMIZE else max
    running = [better(values[: i + 1]) for i in range(len(values))]
    history.step(numbers, running, where="post", color="C1", label="best so far")
    history.set(title="Optimisation history", xlabel="trial", ylabel=metric)
    history.legend()
    history.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            scores = optuna.importance.get_param_importances(study)
        # Optuna's evaluator warns and returns equal importances when it has too few trials: say so instead
        too_few = [w for w in caught if "too small" in str(w.message)]
        if too_few:
            raise ValueError("too few complete trials for Optuna's evaluator")
    except (RuntimeError, ValueError) as err:  # too few complete trials, or one value everywhere
        scores = {}
        importance.text(0.5, 0.5, f"no importances yet:\n{err}", ha="center", va="center", wrap=True)
        importance.set_xticks([])
        importance.set_yticks([])
    if scores:
        names = list(scores)[::-1]
        importance.barh([n.rsplit(".init_args.", 1)[-1] for n in names], [scores[n] for n in names])
    importance.set(title="Parameter importances", xlabel="importance")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)

"""A sweep's results: trials.csv and a console table, best.yaml (re-runnable with `make train`), report.png.

The PNG is drawn here with matplotlib (history + importances side by side in one figure): Optuna's
`optuna.visualization.matplotlib.plot_*` functions each draw their own figure and are marked experimental, and
the plotly versions need plotly and a browser or kaleido to become a PNG. The history shows pruned trials too (at
their last reported value) and clips its y axis when a few trials lie far from the rest (saying so in its title).
The importances are Optuna's (`optuna.importance.get_param_importances` with its default evaluator,
PedAnovaImportanceEvaluator, named in the panel's title).
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
    import matplotlib.pyplot as plt

    fig = figure(study, metric)
    with atomic_write(path, "wb") as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)


# Optuna's default importance evaluator (get_param_importances without one), named here so the panel can say which
# method ranked the parameters.
IMPORTANCE_EVALUATOR = optuna.importance.PedAnovaImportanceEvaluator


def last_value(trial) -> float | None:
    """A complete trial's value; a pruned trial's last reported value (the epoch it was stopped at)."""
    if trial.state == TrialState.COMPLETE:
        return trial.value
    if trial.intermediate_values:
        return trial.intermediate_values[max(trial.intermediate_values)]
    return None


def axis_limits(values: list[float]) -> tuple[float, float] | None:
    """y limits that keep the bulk of the values readable: None when no value lies beyond 3 interquartile ranges
    of the quartiles (a diverged or barely trained trial would otherwise squash every other point into a line)."""
    import numpy as np

    if len(values) < 4:
        return None
    q1, q3 = np.percentile(values, [25, 75])
    spread = (q3 - q1) or (abs(float(np.median(values))) * 0.1) or 1e-12
    inside = [v for v in values if q1 - 3 * spread <= v <= q3 + 3 * spread]
    if len(inside) == len(values):
        return None
    pad = 0.08 * ((max(inside) - min(inside)) or spread)
    return min(inside) - pad, max(inside) + pad


def figure(study: optuna.Study, metric: str):
    """History (complete trials, pruned ones at their last reported value, the best so far) and importances."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trials = study.get_trials(deepcopy=False)
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    pruned = [t for t in trials if t.state == TrialState.PRUNED and last_value(t) is not None]
    fig, (history, importance) = plt.subplots(1, 2, figsize=(12, 4.5))
    numbers = [t.number for t in complete]
    values = [t.value for t in complete]
    history.scatter(numbers, values, s=18, label="complete")
    if pruned:
        history.scatter(
            [t.number for t in pruned],
            [last_value(t) for t in pruned],
            s=22,
            marker="x",
            color="C7",
            label="pruned (last reported value)",
        )
    better = min if study.direction == optuna.study.StudyDirection.MINIMIZE else max
    running = [better(values[: i + 1]) for i in range(len(values))]
    history.step(numbers, running, where="post", color="C1", label="best so far")
    title = "Optimisation history"
    shown = [*values, *(last_value(t) for t in pruned)]
    limits = axis_limits(shown)
    if limits is not None:
        low, high = limits
        off = [(t.number, v) for t, v in zip([*complete, *pruned], shown) if not low <= v <= high]
        # the trials beyond the axis stay visible: drawn at its edge, pointing the way they went
        for edge, marker, side in (
            (high, "^", [p for p in off if p[1] > high]),
            (low, "v", [p for p in off if p[1] < low]),
        ):
            if side:
                history.scatter(
                    [n for n, _ in side],
                    [edge] * len(side),
                    marker=marker,
                    color="C3",
                    s=30,
                    clip_on=False,
                    label=f"off the scale ({', '.join(f'{v:.3g}' for _, v in side[:3])}{', ...' if len(side) > 3 else ''})",
                )
        history.set_ylim(low, high)
        title += f"\ny axis clipped: {len(off)} trial(s) beyond it, drawn at its edge"
    history.set(title=title, xlabel="trial", ylabel=metric)
    history.legend(fontsize="small")
    history.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    evaluator = IMPORTANCE_EVALUATOR()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            scores = optuna.importance.get_param_importances(study, evaluator=evaluator)
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
    importance.set(
        title=f"Parameter importances ({type(evaluator).__name__})", xlabel="importance (complete trials)"
    )
    fig.tight_layout()
    return fig

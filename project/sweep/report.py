"""A sweep's results: trials.csv and a console table, best.yaml (re-runnable with `make train`), and Optuna's
plots: report.png (the optimisation history), curves.png (every trial's metric per epoch, pruned ones included)
and importances.png (the parameter importances of Optuna's default evaluator)."""

import csv
import os
import shlex
import sys
from pathlib import Path

import optuna
import yaml
from optuna.trial import TrialState

from project.atomic import atomic_write, write_text_atomic
from project.sweep.worker import TRIAL_CONFIG, trial_dir


def write_report(study: optuna.Study, sweep_dir: Path, configs: list[str], metric: str) -> Path | None:
    """Write trials.csv, best.yaml and the plots into the sweep directory, print the table; best.yaml's path."""
    trials = study.get_trials(deepcopy=False)
    keys = sorted({k for t in trials for k in t.params})
    rows = [row(t, keys) for t in trials]
    with atomic_write(
        Path(sweep_dir) / "trials.csv", newline=""
    ) as handle:  # several workers may report at once
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]) if rows else ["number"])
        writer.writeheader()
        writer.writerows(rows)
    print_table(study, rows, keys, metric)
    if not any(t.state == TrialState.COMPLETE for t in trials):
        print("No complete trial yet: no best.yaml.", flush=True)
        return None
    best, best_path = study.best_trial, Path(sweep_dir) / "best.yaml"
    write_text_atomic(best_path, best_yaml(best, Path(sweep_dir), configs, metric, study))
    plot(study, Path(sweep_dir), metric)
    print(
        f"Best: trial {best.number}, {metric} = {best.value:.6g}. Re-run it: {rerun_command(best_path, configs)}"
    )
    print(f"Sweep directory: {sweep_dir}", flush=True)
    return best_path


def row(trial: optuna.trial.FrozenTrial, keys: list[str]) -> dict:
    return {
        "number": trial.number,
        "state": trial.state.name,
        "value": "" if trial.value is None else trial.value,
        **{k: trial.params.get(k, "") for k in keys},
        "epochs": max(trial.intermediate_values) + 1 if trial.intermediate_values else "",
        "seconds": round(trial.duration.total_seconds(), 1) if trial.duration else "",
        "run_dir": trial.user_attrs.get("run_dir", ""),
        "error": trial.user_attrs.get("error", ""),
    }


def print_table(study: optuna.Study, rows: list[dict], keys: list[str], metric: str) -> None:
    from rich.console import Console
    from rich.table import Table

    best = study.best_trial.number if any(r["state"] == "COMPLETE" for r in rows) else None
    table = Table(title=f"Sweep '{study.study_name}': {metric} ({study.direction.name.lower()})")
    for column in ["#", "state", metric, *[k.rsplit(".", 1)[-1] for k in keys], "epochs", "s"]:
        table.add_column(column, no_wrap=True)
    table.add_column("error", overflow="ellipsis", no_wrap=True, max_width=60)
    for r in rows:
        cells = [r["value"], *(r[k] for k in keys), r["epochs"], r["seconds"], r["error"]]
        shown = [f"{c:.4g}" if isinstance(c, float) else str(c) for c in cells]
        table.add_row(f"{r['number']}{' *' if r['number'] == best else ''}", r["state"], *shown)
    # Piped or in a log file Rich would assume 80 columns and cut every column short.
    Console(width=None if sys.stdout.isatty() else 200).print(table)


def best_yaml(best, sweep_dir: Path, configs: list[str], metric: str, study: optuna.Study) -> str:
    """The best trial's own overlay (fixed keys + its parameters) without the sweep's pruning callback."""
    overlay = yaml.safe_load((trial_dir(sweep_dir, best.number) / TRIAL_CONFIG).read_text())
    overlay.get("trainer", {}).pop("callbacks+", None)
    if not overlay.get("trainer", True):
        overlay.pop("trainer")
    threads = best.user_attrs.get("omp_num_threads")
    header = [
        f"# Best trial of sweep '{study.study_name}': trial {best.number}, {metric} = {best.value!r} "
        f"({study.direction.name.lower()}), run {best.user_attrs.get('run_dir', '')}",
        f"# Re-run: {rerun_command(sweep_dir / 'best.yaml', configs)}",
        "# The same metric, bit for bit, needs the same machine, seed and thread count: the trial ran with "
        + (
            f"OMP_NUM_THREADS={threads}."
            if threads
            else "torch's default thread count (OMP_NUM_THREADS unset)."
        ),
    ]
    return "\n".join(header) + "\n" + yaml.safe_dump(overlay, sort_keys=False)


def rerun_command(best_path: Path, configs: list[str]) -> str:
    if [os.path.normpath(c) for c in configs] == [os.path.normpath("configs/default.yaml")]:
        return f'make train ARGS="--config {best_path}"'
    return "python -m project fit " + " ".join(
        f"--config {shlex.quote(c)}" for c in [*configs, str(best_path)]
    )


def plot(study: optuna.Study, sweep_dir: Path, metric: str) -> None:
    """Optuna's matplotlib plots, each a PNG; one that cannot be drawn (too few trials for importances) is said."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as plots

    for name, draw in (
        ("report.png", plots.plot_optimization_history),
        ("curves.png", plots.plot_intermediate_values),
        ("importances.png", plots.plot_param_importances),
    ):
        try:
            kwargs = {} if draw is plots.plot_intermediate_values else {"target_name": metric}
            figure = draw(study, **kwargs).figure
            with atomic_write(sweep_dir / name, "wb") as handle:
                figure.savefig(handle, format="png", dpi=100, bbox_inches="tight")
            plt.close(figure)
        except Exception as err:  # a plot must not cost the sweep its results
            print(f"{name} not written: {err}", flush=True)

"""A sweep's results: trials.csv and a console table, best.yaml (re-runnable with `make train`), and Optuna's
plots: report.png (the optimisation history), curves.png (every trial's metric per epoch, pruned ones included)
and importances.png (the parameter importances of Optuna's default evaluator)."""

import csv
import os
import shlex
import sys
import warnings
from pathlib import Path

import optuna
import yaml

from project.atomic import atomic_write, write_text_atomic
from project.sweep.worker import TRIAL_CONFIG, trial_dir


def write_report(study: optuna.Study, sweep_dir: Path, configs: list[str], metric: str) -> Path | None:
    from rich.console import Console
    from rich.table import Table

    sweep_dir, trials = Path(sweep_dir), study.get_trials(deepcopy=False)
    keys = sorted({k for t in trials for k in t.params})
    rows = [row(t, keys) for t in trials]
    with atomic_write(sweep_dir / "trials.csv", newline="") as handle:  # several workers may report at once
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]) if rows else ["number"])
        writer.writeheader()
        writer.writerows(rows)
    best = study.best_trial if any(r["state"] == "COMPLETE" for r in rows) else None
    table = Table(title=f"Sweep '{study.study_name}': {metric} ({study.direction.name.lower()})")
    for column in ["#", "state", metric, *(k.rsplit(".", 1)[-1] for k in keys), "epochs", "s", "error"]:
        table.add_column(column, no_wrap=True, max_width=60)
    for r in rows:
        r["number"] = f"{r['number']} *" if best and r["number"] == best.number else r["number"]
        table.add_row(*(f"{v:.4g}" if isinstance(v, float) else str(v) for v in list(r.values())[:-1]))
    # Piped or in a log file Rich would assume 80 columns and cut every column short.
    Console(width=None if sys.stdout.isatty() else 200).print(table)
    if best is None:
        print("No complete trial yet: no best.yaml.", flush=True)
        return None
    write_text_atomic(sweep_dir / "best.yaml", best_yaml(best, sweep_dir, configs, metric, study))
    plot(study, sweep_dir, metric)
    print(f"Best: trial {best.number}, {metric} = {best.value:.6g}. Re-run it: {rerun(sweep_dir, configs)}")
    print(f"Sweep directory: {sweep_dir}", flush=True)
    return sweep_dir / "best.yaml"


def row(trial: optuna.trial.FrozenTrial, keys: list[str]) -> dict:
    return {
        "number": trial.number,
        "state": trial.state.name,
        "value": "" if trial.value is None else trial.value,
        **{k: trial.params.get(k, "") for k in keys},
        "epochs": max(trial.intermediate_values) + 1 if trial.intermediate_values else "",
        "seconds": round(trial.duration.total_seconds(), 1) if trial.duration else "",
        "error": trial.user_attrs.get("error", ""),
        "run_dir": trial.user_attrs.get("run_dir", ""),
    }


def best_yaml(best, sweep_dir: Path, configs: list[str], metric: str, study: optuna.Study) -> str:
    """The best trial's overlay (fixed keys, its parameters) without the sweep's pruning callback."""
    overlay = yaml.safe_load((trial_dir(sweep_dir, best.number) / TRIAL_CONFIG).read_text())
    overlay.get("trainer", {}).pop("callbacks+", None)
    if not overlay.get("trainer", True):
        overlay.pop("trainer")
    threads = best.user_attrs.get("omp_num_threads")
    ran = f"OMP_NUM_THREADS={threads}" if threads else "torch's default thread count (OMP_NUM_THREADS unset)"
    return (
        f"# Best trial of sweep '{study.study_name}': trial {best.number}, {metric} = {best.value!r} "
        f"({study.direction.name.lower()}), run {best.user_attrs.get('run_dir', '')}\n"
        f"# Re-run: {rerun(sweep_dir, configs)}\n"
        f"# The same metric, bit for bit, needs the same machine, seed and thread count: the trial ran with {ran}.\n"
        + yaml.safe_dump(overlay, sort_keys=False)
    )


def rerun(sweep_dir: Path, configs: list[str]) -> str:
    if [os.path.normpath(c) for c in configs] == [os.path.normpath("configs/default.yaml")]:
        return f'make train ARGS="--config {sweep_dir / "best.yaml"}"'
    configs = [*configs, str(sweep_dir / "best.yaml")]
    return "python -m project fit " + " ".join(f"--config {shlex.quote(c)}" for c in configs)


def plot(study: optuna.Study, sweep_dir: Path, metric: str) -> None:
    """Optuna's matplotlib plots, each a PNG; one that cannot be drawn (too few trials for importances) is said."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as plots

    for name, draw in (
        ("report.png", lambda: plots.plot_optimization_history(study, target_name=metric)),
        ("curves.png", lambda: plots.plot_intermediate_values(study)),
        ("importances.png", lambda: plots.plot_param_importances(study, target_name=metric)),
    ):
        try:
            with warnings.catch_warnings():  # too few trials: Optuna warns, and its importances are all equal
                warnings.filterwarnings("error", "The number of trials is too small")
                figure = draw().figure
            with atomic_write(sweep_dir / name, "wb") as handle:
                figure.savefig(handle, format="png", dpi=100, bbox_inches="tight")
            plt.close(figure)
        except Exception as err:  # a plot must not cost the sweep its results
            print(f"{name} not written: {err}", flush=True)

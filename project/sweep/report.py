"""A sweep's results: a console table and trials.csv, best.yaml (re-run with `make train`) and Optuna's plots."""

import csv
import shlex
import sys
import warnings
from pathlib import Path

import optuna
import yaml

from project.atomic import atomic_write, write_text_atomic
from project.sweep.worker import TRIAL_CONFIG, trial_dir


def write_report(study: optuna.Study, sweep_dir: Path, configs: list[str], metric: str) -> None:
    from rich.console import Console
    from rich.table import Table

    trials, direction = study.get_trials(deepcopy=False), study.direction.name.lower()
    keys = sorted({k for t in trials for k in t.params})
    rows = [
        {
            "number": t.number,
            "state": t.state.name,
            "value": "" if t.value is None else t.value,
            **{k: t.params.get(k, "") for k in keys},
            "epochs": max(t.intermediate_values) + 1 if t.intermediate_values else "",
            "seconds": round(t.duration.total_seconds(), 1) if t.duration else "",
            "error": t.user_attrs.get("error", ""),
            "run_dir": t.user_attrs.get("run_dir", ""),
        }
        for t in trials
    ]
    with atomic_write(
        Path(sweep_dir, "trials.csv"), newline=""
    ) as handle:  # several workers may report at once
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]) if rows else ["number"])
        writer.writeheader()
        writer.writerows(rows)
    best = study.best_trial if any(r["state"] == "COMPLETE" for r in rows) else None
    table = Table(title=f"Sweep '{study.study_name}': {metric} ({direction})")
    for column in ["#", "state", metric, *(k.rsplit(".", 1)[-1] for k in keys), "epochs", "s", "error"]:
        table.add_column(column, no_wrap=True, max_width=60)
    for r in rows:
        r["number"] = f"{r['number']} *" if best and r["number"] == best.number else r["number"]
        table.add_row(*(f"{v:.4g}" if isinstance(v, float) else str(v) for v in list(r.values())[:-1]))
    Console(width=None if sys.stdout.isatty() else 200).print(table)  # piped, Rich would cut at 80 columns
    if best is None:
        return print("No complete trial yet: no best.yaml.", flush=True)
    # The best trial's overlay without the sweep's pruning callback.
    overlay = yaml.safe_load((trial_dir(sweep_dir, best.number) / TRIAL_CONFIG).read_text())
    overlay.get("trainer", {}).pop("callbacks+", None)
    if not overlay.get("trainer", True):
        overlay.pop("trainer")
    rerun = " ".join(f"--config {shlex.quote(c)}" for c in [*configs, str(Path(sweep_dir, "best.yaml"))])
    rerun = (
        f'make train ARGS="{rerun}"'
        if configs == ["configs/default.yaml"]
        else f"python -m project fit {rerun}"
    )
    threads = best.user_attrs.get("omp_num_threads")
    threads = (
        f"OMP_NUM_THREADS={threads}" if threads else "torch's default thread count (OMP_NUM_THREADS unset)"
    )
    write_text_atomic(
        Path(sweep_dir, "best.yaml"),
        f"# Best trial of sweep '{study.study_name}': trial {best.number}, {metric} = {best.value!r} ({direction}), "
        f"run {trial_dir(sweep_dir, best.number)}\n# Re-run: {rerun}\n# The same metric, bit for bit, needs the same "
        f"machine, seed and thread count: the trial ran with {threads}.\n"
        + yaml.safe_dump(overlay, sort_keys=False),
    )
    plot(study, Path(sweep_dir), metric)
    print(
        f"Best: trial {best.number}, {metric} = {best.value:.6g}. Re-run it: {rerun}\nSweep directory: {sweep_dir}"
    )


def plot(study: optuna.Study, sweep_dir: Path, metric: str) -> None:
    """Optuna's matplotlib plots; one that cannot be drawn (too few trials for importances) is said."""
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

"""A sweep's results: a console table and trials.csv, best.yaml (re-run with `make train`) and Optuna's plots."""

import csv
import shlex
import sys
import warnings
from pathlib import Path

import optuna
import yaml
from optuna.trial import TrialState

from project.atomic import atomic_write, write_text_atomic
from project.sweep.worker import TRIAL_CONFIG, trial_dir


def write_report(study: optuna.Study, sweep_dir: Path, configs: list[str], metric: str) -> None:
    from rich.console import Console
    from rich.table import Table

    sweep_dir, trials, direction = Path(sweep_dir), study.get_trials(deepcopy=False), study.direction.name
    keys, direction = sorted({k for t in trials for k in t.params}), direction.lower()
    best = study.best_trial if any(t.state == TrialState.COMPLETE for t in trials) else None
    header = ["number", "state", "value", *keys, "epochs", "seconds", "error", "run_dir"]
    rows = [row(t, keys) for t in trials]
    with atomic_write(sweep_dir / "trials.csv", newline="") as handle:  # several workers may report at once
        csv.writer(handle).writerows([header, *rows])
    title = f"Sweep '{study.study_name}': {metric} ({direction})"
    table = Table(*(h.rsplit(".", 1)[-1] for h in header[:-1]), title=title)
    for r in rows:
        cells = ("" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)[:80] for v in r[:-1])
        table.add_row(*cells, style="bold" if best and r[0] == best.number else None)  # the best in bold
    Console(width=None if sys.stdout.isatty() else 200).print(table)  # piped, Rich would cut at 80 columns
    if best is None:
        return print("No complete trial yet: no best.yaml.")
    overlay = yaml.safe_load((trial_dir(sweep_dir, best.number) / TRIAL_CONFIG).read_text())
    overlay.pop("trainer.callbacks+", None)  # the sweep's own callback
    best_yaml = f"--config {shlex.quote(str(sweep_dir / 'best.yaml'))}"
    rerun = "python -m project fit " + " ".join([*(f"--config {shlex.quote(c)}" for c in configs), best_yaml])
    if configs == ["configs/default.yaml"]:
        rerun = f'make train ARGS="{best_yaml}"'

    threads = best.user_attrs.get("omp_num_threads")
    write_text_atomic(
        sweep_dir / "best.yaml",
        f"# Best trial of sweep '{study.study_name}': trial {best.number}, {metric} = {best.value!r} ({direction}), "
        f"run {trial_dir(sweep_dir, best.number)}\n# Re-run: {rerun}\n# The same metric, bit for bit, needs the same "
        f"machine, seed and thread count: the trial ran with OMP_NUM_THREADS={threads or 'unset (torch default)'}.\n"
        + yaml.safe_dump(overlay, sort_keys=False),
    )
    plot(study, sweep_dir, metric)
    print(f"Best: trial {best.number}, {metric} = {best.value:.6g}. Re-run it: {rerun}")


def row(t: optuna.trial.FrozenTrial, keys: list[str]) -> list:
    epochs, seconds = len(t.intermediate_values) or None, t.duration and round(t.duration.total_seconds(), 1)
    error, run_dir = t.user_attrs.get("error"), t.user_attrs.get("run_dir")
    return [t.number, t.state.name, t.value, *map(t.params.get, keys), epochs, seconds, error, run_dir]


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

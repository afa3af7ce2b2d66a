"""`python -m project sweep` (`make sweep`): an Optuna study around the same `fit` that `make train` runs.

    python -m project sweep [--space configs/sweep/digits.yaml] [--config configs/default.yaml ...] [--dir DIR]
        [--storage URL] [--n_trials N] [--workers N] [--worker_index K] [--report] [--dotted.key value ...]

Dotted flags (`--trainer.max_epochs 3`, as `make train` takes them) are fixed for every trial and land in best.yaml. Running the same
command again resumes the sweep: the study is loaded (`load_if_exists`), finished trials are kept and the dead
workers' trials are re-run (project/sweep/worker.py). `--report` only writes the results of what is there.

Hydra's Optuna sweeper and Lightning's Tuner were not used: the first needs Hydra configs (this template's configs
are LightningCLI's) and runs trials inside its own process (no isolation of a NaN or a kill, no resume of a dead
worker's trial); the second tunes the learning rate and batch size only. W&B sweeps need W&B's server (no offline sweep).
The optuna-dashboard web UI is not offered (untested here): `report.png` and trials.csv are the view of a study.
"""

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

import yaml

from project.atomic import write_text_atomic
from project.errors import ConfigError

DEFAULT_SPACE = "configs/sweep/digits.yaml"
SWEEPS_DIR = Path("runs") / "sweeps"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m project sweep",
        allow_abbrev=False,  # a trial flag such as --data.init_args.batch_size is never taken for --dir
        description="Hyperparameter sweep: an Optuna study whose trials are `python -m project fit` runs.",
        epilog="Dotted training flags (e.g. --trainer.max_epochs 3) are given to every trial and kept in best.yaml.",
    )
    p.add_argument("--space", default=DEFAULT_SPACE, help="sweep file: parameters, metric, sampler, pruner")
    p.add_argument(
        "--config", action="append", help="base config(s) of every trial (default configs/default.yaml)"
    )
    p.add_argument("--dir", help="sweep directory (default runs/sweeps/<name>): trials/, study.db, best.yaml")
    p.add_argument(
        "--storage",
        help="study storage: an RDB URL (postgresql://...) or journal:<file> (default: "
        "sqlite:///<dir>/study.db)",
    )
    p.add_argument("--study", help="study name (default: the sweep file's name)")
    p.add_argument(
        "--n_trials", type=int, help="finished (complete or pruned) trials to reach, all workers together"
    )
    p.add_argument("--max_failed", type=int, help="stop after this many failed trials (default: n_trials)")
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="worker processes on this machine (each runs one trial "
        "at a time; without OMP_NUM_THREADS they share the cores)",
    )
    p.add_argument(
        "--worker_index",
        type=int,
        default=0,
        help="this worker's number: its sampler's seed is the sweep "
        "file's + 1000 x this + the trials already in the study (give each worker started at the same time "
        "its own; WORKERS and the SLURM script do)",
    )
    p.add_argument(
        "--report", action="store_true", help="only write the results (table, best.yaml, report.png)"
    )
    p.add_argument("--no_report", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--checked", action="store_true", help=argparse.SUPPRESS)  # workers of a checked sweep
    return p


def trial_flags(tokens: list[str]) -> dict:
    """`--a.b 1 --c.d=x` -> {'a.b': 1, 'c.d': 'x'}: flags for every trial (dotted keys, as `make train` takes
    them), values read as YAML like the training CLI reads them. A `--` before them is optional."""
    tokens = [t for t in tokens if t != "--"]
    fixed = {}
    while tokens:
        flag = tokens.pop(0)
        key, eq, value = flag[2:].partition("=") if flag.startswith("--") else ("", "", "")
        if "." not in key:
            raise ConfigError(
                f"Unknown sweep flag '{flag}'. Sweep flags: python -m project sweep --help; flags for every trial "
                "are dotted training keys with a value, e.g. --trainer.max_epochs 3."
            )
        if not eq:
            if not tokens:
                raise ConfigError(f"Trial flag '{flag}' has no value, e.g. {flag} 3.")
            value = tokens.pop(0)
        fixed[key] = yaml.safe_load(value)
    return fixed


def monitor_of(configs: list[str]) -> tuple[str, str]:
    """The first ModelCheckpoint's monitor and mode in the base configs (what checkpoint selection uses)."""
    from project.sweep.space import merge

    tree: dict = {}
    for config in configs:
        tree = merge(tree, yaml.safe_load(Path(config).read_text()) or {})
    for callback in (tree.get("trainer") or {}).get("callbacks") or []:
        init = (callback or {}).get("init_args") or {}
        if (
            isinstance(callback, dict)
            and callback.get("class_path", "").endswith("Checkpoint")
            and init.get("monitor")
        ):
            return init["monitor"], init.get("mode", "min")
    raise ConfigError(
        "No ModelCheckpoint with a `monitor` in the base config: set `metric` and `direction` in the "
        "sweep file."
    )


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        sys.exit(run(argv))
    except ConfigError as err:
        print(f"\nerror: {err}\n", file=sys.stderr, flush=True)
        sys.exit(2)
    except KeyboardInterrupt:
        print("\nSweep stopped. The same command resumes it; the stopped trial runs again.", file=sys.stderr)
        sys.exit(130)


def run(argv: list[str]) -> int:
    import optuna

    from project.sweep.report import write_report
    from project.sweep.space import load_space
    from project.sweep.storage import default_storage
    from project.sweep.worker import Sweep, run_worker

    args, rest = parser().parse_known_args(argv)
    flags = trial_flags(rest)
    space = load_space(args.space)
    configs = args.config or ["configs/default.yaml"]
    for config in configs:
        if not Path(config).is_file():
            raise ConfigError(f"Base config '{config}' not found; pass an existing file with --config.")
    sweep_dir = Path(args.dir or SWEEPS_DIR / space.name)
    storage_url = args.storage or default_storage(sweep_dir)
    study_name = args.study or space.name
    monitor, mode = monitor_of(configs)
    metric = space.metric or monitor
    direction = space.direction or ("maximize" if space.metric is None and mode == "max" else "minimize")
    if space.metric and not space.direction:
        raise ConfigError(
            f"The sweep file sets metric '{space.metric}' without a direction: add direction: "
            "minimize or maximize."
        )
    threads = os.environ.get("OMP_NUM_THREADS") or (
        str(max(1, (os.cpu_count() or 1) // args.workers)) if args.workers > 1 else None
    )
    # Bad input stops here, before the storage is opened: a new sweep creates nothing, an existing one is untouched.
    if args.report:
        study = existing_study(storage_url, sweep_dir, study_name)
        if study is None:
            raise ConfigError(
                f"No study '{study_name}' in {storage_url}: run the sweep first, or pass the --space, --dir "
                "(or --storage) and --study it ran with."
            )
        check_study(study, storage_url, metric, direction)
        if study.user_attrs.get(METRIC_ATTR) != metric:  # a study from before the metric was recorded
            check_inputs(args.space, space, configs, flags, metric, monitor, threads, keys=False)
        write_report(study, sweep_dir, configs, metric)
        return 0
    if not args.checked:  # --workers N: the parent checked once for its N workers
        check_inputs(args.space, space, configs, flags, metric, monitor, threads, keys=True)
    study = existing_study(storage_url, sweep_dir, study_name)
    if study is not None:
        check_study(study, storage_url, metric, direction)

    from project.sweep.storage import open_storage

    optuna.logging.set_verbosity(optuna.logging.INFO)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    storage = open_storage(storage_url)
    study = create_study(study_name, storage, direction, space, configs, metric)
    space_copy = sweep_dir / "space.yaml"
    if not space_copy.exists() or space_copy.read_text() != Path(args.space).read_text():
        write_text_atomic(space_copy, Path(args.space).read_text())
    n_trials = args.n_trials or space.n_trials
    if args.workers > 1:
        code = run_workers(argv, args.workers, threads)
    else:
        # --max_failed counts the failures of this command: earlier runs' failures (a key since corrected, a range
        # since narrowed) must not stop the sweep that resumes or extends them before it runs anything.
        failed_before = sum(
            t.state == optuna.trial.TrialState.FAIL and "error" in t.user_attrs
            for t in study.get_trials(deepcopy=False)
        )
        if failed_before:
            print(
                f"{failed_before} failed trial(s) from earlier runs do not count towards --max_failed.",
                flush=True,
            )
        sweep = Sweep(
            space=space,
            space_copy=space_copy.resolve(),
            sweep_dir=sweep_dir,
            storage_url=storage_url,
            study_name=study_name,
            configs=configs,
            fixed={**space.fixed, **flags},
            metric=metric,
            monitor=monitor,
            direction=direction,
            n_trials=n_trials,
            max_failed=(args.max_failed or n_trials) + failed_before,
            threads=threads,
            failed_before=failed_before,
        )
        study = optuna.load_study(
            study_name=study_name,
            storage=storage,
            # Seeded samplers draw the same numbers in every process: each worker, and each resumption, starts the
            # seed elsewhere (a single worker's fresh sweep keeps the sweep file's seed, so it repeats exactly).
            sampler=space.build_sampler(1000 * args.worker_index + len(study.get_trials(deepcopy=False))),
            pruner=space.build_pruner(),
        )
        signal.signal(
            signal.SIGTERM, _raise_interrupt
        )  # SIGTERM (SLURM, kill): like Ctrl+C, re-queue the trial
        code = run_worker(sweep, study)
    if not args.no_report:
        write_report(study, sweep_dir, configs, metric)
    return code


def check_inputs(space_path, space, configs, flags, metric, monitor, threads, keys: bool) -> None:
    """The sweep's keys and values against the training CLI (keys=True), and its metric against what a trial
    of this config reports (project/sweep/check.py); a ConfigError names every problem and its fix."""
    import time

    from project.doctor import training_config
    from project.sweep.check import check_keys, check_metric, nest, overlay_file, reported_metrics, writes_csv

    start = time.monotonic()
    where = f"sweep {space_path}"
    if keys:
        values, config = check_keys(configs, space, flags, where)
    else:
        values = {}
        config = training_config(
            [
                *(a for c in configs for a in ("--config", c)),
                "--config",
                overlay_file(nest({**space.fixed, **flags})),
            ]
        )
    names = reported_metrics(configs, {**space.fixed, **flags, **values}, threads)
    check_metric(metric, monitor, names, writes_csv(config), where)
    print(
        f"Checked in {time.monotonic() - start:.0f} s: "
        + ("the training CLI accepts every key and value of the sweep; " if keys else "")
        + f"a trial reports {metric} after each validation.",
        flush=True,
    )


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


METRIC_ATTR = "metric"  # the study's user attribute: the metric its trial values are


def existing_study(storage_url: str, sweep_dir: Path, name: str):
    """The study if it exists, else None; a default SQLite file that is not there is not created."""
    import optuna

    from project.sweep.storage import default_storage, open_storage

    if storage_url == default_storage(sweep_dir) and not (Path(sweep_dir) / "study.db").exists():
        return None
    try:
        return optuna.load_study(study_name=name, storage=open_storage(storage_url, heartbeat=False))
    except KeyError:
        return None


def check_study(study, storage_url: str, metric: str, direction: str) -> None:
    """An existing study's trial values are one metric in one direction: another would mix them (best.yaml and
    report.png would name the new metric for the old values)."""
    had = study.user_attrs.get(METRIC_ATTR)
    had_direction = study.direction.name.lower()
    if had_direction != direction or (had is not None and had != metric):
        raise ConfigError(
            f"Study '{study.study_name}' in {storage_url} ranks its trials by {had or 'its metric'} "
            f"({had_direction}), not {metric} ({direction}): its values and best.yaml would mix the two. Use "
            "another --dir/--study for another metric, or the study's own metric and direction in the sweep "
            "file. Nothing was changed."
        )


def create_study(name: str, storage, direction: str, space, configs: list[str], metric: str | None = None):
    """Create or load the study; the first time, enqueue the base config's own values as trial 0 (the best trial
    is then never worse than the base config when trials are deterministic). `metric` is recorded in the study."""
    from project.sweep.space import base_values
    from project.sweep.storage import create_or_load

    study, created = create_or_load(name, storage, direction)
    if study.direction.name.lower() != direction:
        raise ConfigError(
            f"Study '{name}' exists with direction {study.direction.name.lower()}, not {direction}: "
            "use another --dir/--study, or the same metric and direction as before."
        )
    if metric is not None and study.user_attrs.get(METRIC_ATTR) is None:
        study.set_user_attr(METRIC_ATTR, metric)
    if created and space.enqueue_base:
        values = base_values(space, configs)
        if values:
            study.enqueue_trial(values, user_attrs={"base_config": True})
    return study


def run_workers(argv: list[str], workers: int, threads: str | None) -> int:
    """`workers` copies of this command with --workers 1 and their own --worker_index; each runs its trials."""
    from project.sweep.worker import die_with_parent

    base = [
        sys.executable,
        "-m",
        "project",
        "sweep",
        *strip_flag(strip_flag(argv, "--workers"), "--worker_index"),
    ]
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = threads
    print(f"{workers} workers, OMP_NUM_THREADS={threads or 'unset'} in each trial", flush=True)
    processes = [
        subprocess.Popen(
            [*base, "--no_report", "--checked", "--workers", "1", "--worker_index", str(k)],
            env=env,
            preexec_fn=die_with_parent if sys.platform.startswith("linux") else None,
        )
        for k in range(workers)
    ]
    return max(p.wait() for p in processes)


def strip_flag(argv: list[str], flag: str) -> list[str]:
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item == flag:
            skip = True
        elif not item.startswith(f"{flag}="):
            out.append(item)
    return out

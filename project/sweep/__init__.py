"""`python -m project sweep` (`make sweep`): an Optuna study around the same `fit` that `make train` runs.

    python -m project sweep [--space configs/sweep/digits.yaml] [--config configs/default.yaml ...] [--dir DIR]
        [--storage URL] [--n_trials N] [--workers N] [--worker_index K] [--report] [--dotted.key value ...]

Running the same command again resumes the sweep: the study is loaded, finished trials are kept and dead workers'
trials are re-run. Hydra's Optuna sweeper needs Hydra configs and runs trials inside its own process (no isolation
of a NaN or a kill); Lightning's Tuner tunes only the learning rate and batch size; W&B sweeps need W&B's server.
"""

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

import yaml

from project.errors import ConfigError


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m project sweep",
        allow_abbrev=False,  # a trial flag such as --data.init_args.batch_size is never taken for --dir
        description="Hyperparameter sweep: an Optuna study whose trials are `python -m project fit` runs.",
        epilog="Dotted training flags (e.g. --trainer.max_epochs 3) are given to every trial and kept in best.yaml.",
    )
    add = p.add_argument
    add(
        "--space", default="configs/sweep/digits.yaml", help="sweep file: parameters, metric, sampler, pruner"
    )
    add("--config", action="append", help="base config(s) of every trial (default configs/default.yaml)")
    add("--dir", help="sweep directory (default runs/sweeps/<name>): trials/, study.db, best.yaml")
    add("--storage", help="postgresql://..., mysql+pymysql://... or journal:<file> (default: <dir>/study.db)")
    add("--study", help="study name (default: the sweep file's name)")
    add("--n_trials", type=int, help="finished (complete or pruned) trials to reach, all workers together")
    add(
        "--max_failed",
        type=int,
        help="stop after this many failed trials of this command (default: n_trials)",
    )
    add("--workers", type=int, default=1, help="worker processes on this machine, one trial at a time each")
    add(
        "--worker_index",
        type=int,
        default=0,
        help="sampler seed offset: give each worker started at once its own",
    )
    add("--report", action="store_true", help="only write the results (table, best.yaml, plots)")
    add("--no_report", action="store_true", help=argparse.SUPPRESS)
    add("--checked", action="store_true", help=argparse.SUPPRESS)  # workers whose parent checked the input
    return p


def trial_flags(tokens: list[str]) -> dict:
    """`--a.b 1 --c.d=x` -> {'a.b': 1, 'c.d': 'x'}: flags for every trial, values read as YAML like the CLI."""
    tokens, fixed = [t for t in tokens if t != "--"], {}
    while tokens:
        flag = tokens.pop(0)
        key, eq, value = flag[2:].partition("=") if flag.startswith("--") else ("", "", "")
        if "." not in key:
            raise ConfigError(
                f"Unknown sweep flag '{flag}'. Sweep flags: python -m project sweep --help; flags for every trial "
                "are dotted training keys with a value, e.g. --trainer.max_epochs 3."
            )
        if not eq and not tokens:
            raise ConfigError(f"Trial flag '{flag}' has no value, e.g. {flag} 3.")
        fixed[key] = yaml.safe_load(value if eq else tokens.pop(0))
    return fixed


def main(argv: list[str] | None = None) -> None:
    try:
        sys.exit(run(list(sys.argv[1:] if argv is None else argv)))
    except ConfigError as err:
        print(f"\nerror: {err}\n", file=sys.stderr, flush=True)
        sys.exit(2)
    except KeyboardInterrupt:
        print("\nSweep stopped. The same command resumes it; the stopped trial runs again.", file=sys.stderr)
        sys.exit(130)


def run(argv: list[str]) -> int:
    import optuna

    from project.sweep import report, space, storage
    from project.sweep.worker import Sweep, die_with_parent, run_worker

    args, rest = parser().parse_known_args(argv)
    flags, sweep_file = trial_flags(rest), space.load_space(args.space)
    configs = args.config or ["configs/default.yaml"]
    for config in configs:
        if not Path(config).is_file():
            raise ConfigError(f"Base config '{config}' not found; pass an existing file with --config.")
    if sweep_file.metric and not sweep_file.direction:
        raise ConfigError(
            f"The sweep file sets metric '{sweep_file.metric}' without a direction: add direction: minimize or "
            "maximize."
        )
    sweep_dir = Path(args.dir or Path("runs", "sweeps", sweep_file.name))
    url, name = args.storage or storage.default_storage(sweep_dir), args.study or sweep_file.name
    monitor, mode = space.monitor_of(configs)
    metric = sweep_file.metric or monitor
    direction = sweep_file.direction or ("maximize" if mode == "max" else "minimize")
    # Bad input stops before the storage is opened: a new sweep creates nothing, an existing one is untouched.
    study = existing_study(url, sweep_dir, name, metric, direction)
    if args.report:
        if study is None:
            raise ConfigError(
                f"No study '{name}' in {url}: run the sweep first, or pass the --space, --dir (or --storage) and "
                "--study it ran with."
            )
        report.write_report(study, sweep_dir, configs, metric)
        return 0
    threads = os.environ.get("OMP_NUM_THREADS") or (
        str(max(1, (os.cpu_count() or 1) // args.workers)) if args.workers > 1 else None
    )
    if not args.checked:  # --workers N: the parent checked once for its N workers
        from project.sweep.check import check_inputs  # imports Lightning

        check_inputs(args.space, sweep_file, configs, flags, metric, monitor, threads)
    optuna.logging.set_verbosity(optuna.logging.INFO)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    opened = storage.open_storage(url)
    try:  # atomic in every storage: of several workers started together, one creates the study and queues trial 0
        study = optuna.create_study(study_name=name, storage=opened, direction=direction)
        values = space.base_values(sweep_file, configs) if sweep_file.enqueue_base else {}
        if values:  # the best trial is then never worse than the base config at the same epochs
            study.enqueue_trial(values, user_attrs={"base_config": True})
    except optuna.exceptions.DuplicatedStudyError:
        study = optuna.load_study(study_name=name, storage=opened)
    if study.user_attrs.get("metric") is None:
        study.set_user_attr("metric", metric)
    if args.workers > 1:
        base = [sys.executable, "-m", "project", "sweep", *drop_flags(argv, "--workers", "--worker_index")]
        print(f"{args.workers} workers, OMP_NUM_THREADS={threads or 'unset'} in each trial", flush=True)
        env = dict(os.environ, **({"OMP_NUM_THREADS": threads} if threads else {}))
        workers = [
            subprocess.Popen(
                [*base, "--no_report", "--checked", "--workers", "1", "--worker_index", str(k)],
                env=env,
                preexec_fn=die_with_parent,
            )
            for k in range(args.workers)
        ]
        code = max(w.wait() for w in workers)
    else:
        first_trial = len(study.get_trials(deepcopy=False))  # --max_failed counts the failures from here on
        # Seeded samplers draw the same numbers in every process: each worker, and each resumption, starts the seed
        # elsewhere (a single worker's fresh sweep keeps the sweep file's seed, so it repeats exactly).
        study.sampler = sweep_file.build_sampler(1000 * args.worker_index + first_trial)
        n_trials = args.n_trials or sweep_file.n_trials
        fixed = {**sweep_file.fixed, **flags}
        sweep = Sweep(
            sweep_file, sweep_dir, url, name, configs, fixed, metric, n_trials, args.max_failed or n_trials
        )
        sweep.first_trial, sweep.threads = first_trial, threads
        signal.signal(
            signal.SIGTERM, _raise_interrupt
        )  # SIGTERM (SLURM, kill): like Ctrl+C, re-queue the trial
        code = run_worker(sweep, study)
    if not args.no_report:
        report.write_report(study, sweep_dir, configs, metric)
    return code


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def existing_study(url: str, sweep_dir: Path, name: str, metric: str, direction: str):
    """The study if it exists (a default SQLite file that is not there is not created), else None. Its trial values
    are one metric in one direction: another would mix them (best.yaml would name the new metric for old values)."""
    import optuna

    from project.sweep.storage import default_storage, open_storage

    if url == default_storage(sweep_dir) and not (Path(sweep_dir) / "study.db").exists():
        return None
    try:
        study = optuna.load_study(study_name=name, storage=open_storage(url, heartbeat=False))
    except KeyError:
        return None
    had, had_direction = study.user_attrs.get("metric"), study.direction.name.lower()
    if had_direction != direction or had not in (None, metric):
        raise ConfigError(
            f"Study '{name}' in {url} ranks its trials by {had or 'its metric'} ({had_direction}), not {metric} "
            f"({direction}): its values and best.yaml would mix the two. Use another --dir/--study for another "
            "metric, or the study's own metric and direction in the sweep file. Nothing was changed."
        )
    return study


def drop_flags(argv: list[str], *flags: str) -> list[str]:
    out, skip = [], False
    for item in argv:
        if not skip and item not in flags and not item.startswith(tuple(f"{f}=" for f in flags)):
            out.append(item)
        skip = not skip and item in flags
    return out

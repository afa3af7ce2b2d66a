"""`python -m project sweep` (`make sweep`): an Optuna study around the same `fit` that `make train` runs.

Running the same command again resumes the sweep: the study is loaded, finished trials are kept and dead workers'
trials run again. Not Hydra's Optuna sweeper (Hydra configs; trials inside its own process, so a NaN or a kill is
not isolated), Lightning's Tuner (learning rate and batch size only) or W&B sweeps (W&B's server).
"""

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

import yaml

from project.errors import ConfigError

DEFAULT = "configs/default.yaml"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m project sweep",
        allow_abbrev=False,  # a trial flag such as --data.init_args.batch_size is never taken for --dir
        description="Hyperparameter sweep: an Optuna study whose trials are `python -m project fit` runs.",
        epilog="Dotted training flags (e.g. --trainer.max_epochs 3) are given to every trial and kept in best.yaml.",
    )
    add = p.add_argument
    add("--space", default="configs/sweep/digits.yaml", help="sweep file: parameters, metric, sampler...")
    add("--config", action="append", help="base config(s) of every trial (default configs/default.yaml)")
    add("--dir", help="sweep directory (default runs/sweeps/<name>): trials/, study.db, best.yaml")
    add("--storage", help="postgresql://..., mysql+pymysql://... or journal:<file> (default: <dir>/study.db)")
    add("--study", help="study name (default: the sweep file's name)")
    add("--n_trials", type=int, help="finished (complete or pruned) trials to reach, all workers together")
    add("--max_failed", type=int, help="failed trials of this command that stop it (default: n_trials)")
    add("--workers", type=int, default=1, help="worker processes on this machine, one trial at a time each")
    add("--worker_index", type=int, default=0, help="sampler seed offset: one of its own for each worker")
    add("--report", action="store_true", help="only write the results (table, best.yaml, plots)")
    # A worker of --workers N: its parent checks the input and writes the report.
    add("--child", action="store_true", help=argparse.SUPPRESS)
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
    flags, sweep_file, configs = trial_flags(rest), space.load_space(args.space), args.config or [DEFAULT]
    for config in configs:
        if not Path(config).is_file():
            raise ConfigError(f"Base config '{config}' not found; pass an existing file with --config.")
    sweep_dir = Path(args.dir or Path("runs", "sweeps", sweep_file.name))
    url, name = args.storage or storage.default_storage(sweep_dir), args.study or sweep_file.name
    monitor, mode = space.monitor_of(configs)
    metric = sweep_file.metric or monitor
    direction = sweep_file.direction or ("maximize" if mode == "max" else "minimize")
    # Bad input stops before the storage is opened: a new sweep creates nothing, an existing one is untouched.
    study = None
    if url != storage.default_storage(sweep_dir) or (sweep_dir / "study.db").exists():
        try:
            study = optuna.load_study(study_name=name, storage=storage.open_storage(url, heartbeat=False))
        except KeyError:
            pass
    had = (study.user_attrs.get("metric"), study.direction.name.lower()) if study else (None, direction)
    if had[1] != direction or had[0] not in (None, metric):  # trial values of two metrics do not rank
        raise ConfigError(
            f"Study '{name}' in {url} ranks its trials by {had[0] or 'its metric'} ({had[1]}), not {metric} "
            f"({direction}): its values and best.yaml would mix the two. Use another --dir/--study for another "
            "metric, or the study's own metric and direction in the sweep file. Nothing was changed."
        )
    if args.report and study is None:
        raise ConfigError(f"No study '{name}' in {url}: pass the --space, --dir/--storage, --study it used.")
    if args.report:
        report.write_report(study, sweep_dir, configs, metric)
        return 0
    if args.workers > 1 and not os.environ.get("OMP_NUM_THREADS"):  # the trials, the dry run and the workers'
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // args.workers))
    if not args.child:
        from project.sweep.check import check_inputs  # imports Lightning

        check_inputs(args.space, sweep_file, configs, flags, metric, monitor)
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
    if args.workers > 1:  # the same command, each its own --worker_index (argparse takes a flag's last value)
        argv = [a for a in argv if a != "--"]  # then no flag below is taken for a trial's
        command = [sys.executable, "-m", "project", "sweep", *argv, "--child", "--workers", "1"]
        print(f"{args.workers} workers, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}", flush=True)
        workers = [
            subprocess.Popen([*command, "--worker_index", str(k)], preexec_fn=die_with_parent)
            for k in range(args.workers)
        ]
        code = max(w.wait() for w in workers)
    else:
        first = len(study.get_trials(deepcopy=False))  # --max_failed counts this command's failures
        # Seeded samplers draw the same numbers in every process: each worker, and each resumption, starts the seed
        # elsewhere (a single worker's fresh sweep keeps the sweep file's seed, so it repeats exactly).
        study.sampler = sweep_file.build_sampler(1000 * args.worker_index + first)
        n_trials = args.n_trials or sweep_file.n_trials
        fixed, max_failed = {**sweep_file.fixed, **flags}, args.max_failed or n_trials
        sweep = Sweep(sweep_file, sweep_dir, url, configs, fixed, metric, n_trials, max_failed, first)
        # SIGTERM (SLURM, kill) stops the trial like Ctrl+C, which queues its values again
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        code = run_worker(sweep, study)
    if not args.child:
        report.write_report(study, sweep_dir, configs, metric)
    return code

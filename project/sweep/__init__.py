"""`python -m project sweep` (`make sweep`): an Optuna study whose trials are `make train` runs; the same command
resumes it. Not Hydra's Optuna sweeper (trials inside its process: a NaN or a kill is not isolated), Lightning's Tuner
(learning rate and batch size only) or W&B sweeps (W&B's server)."""

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
        description="Hyperparameter sweep: an Optuna study whose trials are `python -m project fit` runs.",
    )
    add = p.add_argument
    add("--space", default="configs/sweep/digits.yaml", help="sweep file: parameters, fixed keys, sampler...")
    add("--config", action="append", help="base config(s) of every trial (default configs/default.yaml)")
    add("--dir", help="sweep directory (default runs/sweeps/<name>): trials/, study.db, best.yaml")
    add("--storage", help="postgresql://..., mysql+pymysql://... or journal:<file> (default: <dir>/study.db)")
    add("--study", help="study name (default: the sweep file's name)")
    add("--n_trials", type=int, help="finished (complete or pruned) trials to reach, all workers together")
    add("--max_failed", type=int, help="failed trials of this command that stop it (default: n_trials)")
    add("--workers", type=int, default=1, help="worker processes on this machine, one trial at a time each")
    add("--worker_index", type=int, default=0, help="sampler seed offset: one of its own for each worker")
    add("--report", action="store_true", help="only write the results (table, best.yaml, plots)")
    add("--child", action="store_true", help=argparse.SUPPRESS)  # a worker of --workers N
    return p


def main(argv: list[str] | None = None) -> None:
    try:
        sys.exit(run(sys.argv[1:] if argv is None else argv))
    except ConfigError as err:
        print(f"\nerror: {err}\n", file=sys.stderr, flush=True)
        sys.exit(2)
    except KeyboardInterrupt:
        print("\nSweep stopped. The same command resumes it; the stopped trial runs again.", file=sys.stderr)
        sys.exit(130)


def run(argv: list[str]) -> int:
    import optuna

    from project.atomic import write_text_atomic
    from project.sweep import report, space, storage
    from project.sweep.worker import Sweep, die_with_parent, run_worker

    args = parser().parse_args(argv)
    sweep_file, configs = space.load_space(args.space), args.config or ["configs/default.yaml"]
    if missing := [c for c in configs if not Path(c).is_file()]:
        raise ConfigError(f"Base config {missing[0]} not found: pass an existing file with --config.")
    sweep_dir = Path(args.dir or Path("runs", "sweeps", sweep_file.name))
    url, name = args.storage or storage.default_storage(sweep_dir), args.study or sweep_file.name
    # Bad input stops before the storage is created or written: a new sweep creates nothing, an old one is untouched.
    owner, marker = {"study": name, "storage": args.storage}, sweep_dir / "study.yaml"  # None: <dir>/study.db
    if marker.exists() and (held := yaml.safe_load(marker.read_text())) != owner:
        raise ConfigError(
            f"{sweep_dir} holds study '{held['study']}' (--storage {held['storage'] or 'default'}), not '{name}': two "
            "studies would write into the same trials/NNN folders. Use another --dir. Nothing was changed."
        )
    study = storage.existing_study(url, name, sweep_dir)
    if study and (changed := space.unchangeable(sweep_file, study)):
        raise ConfigError(
            f"Study '{name}' in {url} cannot go on with the new range of {'; '.join(changed)}: Optuna keeps a "
            "parameter's kind and a categorical's choices. Put it back, or use another --dir. Nothing was changed."
        )
    had = (study.user_attrs.get("metric"), study.direction.name.lower()) if study else (None, None)
    if args.report or args.child:
        if study is None:
            raise ConfigError(f"No study '{name}' in {url}: pass the --space, --dir, --storage it used.")
        metric, direction, values = sweep_file.metric or had[0] or "value", sweep_file.direction or had[1], {}
    else:
        from project.sweep.check import check_inputs  # imports Lightning

        if args.workers > 1 and not os.environ.get("OMP_NUM_THREADS"):  # the workers', trials', dry run's
            os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // args.workers))
        metric, direction, values = check_inputs(args.space, sweep_file, configs)
    if study and (had[1] != direction or had[0] not in (None, metric)):  # values of two metrics do not rank
        raise ConfigError(
            f"Study '{name}' in {url} ranks its trials by {had[0] or 'its metric'} ({had[1]}), not {metric} "
            f"({direction}): use another --dir/--study, or the study's metric. Nothing was changed."
        )
    if args.report:
        return report.write_report(study, sweep_dir, configs, metric)
    optuna.logging.set_verbosity(optuna.logging.INFO)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    opened = storage.open_storage(url)
    try:  # atomic in every storage: of workers started together, one creates the study and queues the base trial
        study = optuna.create_study(study_name=name, storage=opened, direction=direction)
        if values:  # the best trial is then never worse than the base config at the same epochs
            study.enqueue_trial(values, user_attrs={"base_config": True})
    except optuna.exceptions.DuplicatedStudyError:
        study = optuna.load_study(study_name=name, storage=opened)
    if study.user_attrs.get("metric") is None:
        study.set_user_attr("metric", metric)
    if not marker.exists():
        write_text_atomic(marker, yaml.safe_dump(owner))
    if args.workers > 1:  # the same command, each its own --worker_index (argparse takes a flag's last value)
        cmd = [sys.executable, "-m", "project", "sweep", *argv, "--child", "--workers=1", "--worker_index"]
        print(f"{args.workers} workers, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}", flush=True)
        workers = [subprocess.Popen([*cmd, str(k)], preexec_fn=die_with_parent) for k in range(args.workers)]
        code = max(w.wait() for w in workers)
    else:
        first = len(study.get_trials(deepcopy=False))  # --max_failed counts this command's failures
        # Seeded samplers draw the same numbers in every process: each worker and each resumption starts elsewhere.
        study.sampler = sweep_file.build_sampler(1000 * args.worker_index + first)
        n = args.n_trials or sweep_file.n_trials
        sweep = Sweep(sweep_file, sweep_dir, url, configs, metric, n, args.max_failed or n, first)
        signal.signal(signal.SIGTERM, signal.default_int_handler)  # SLURM's or kill's stop: as Ctrl+C
        code = run_worker(sweep, study)
    if not args.child:
        report.write_report(study, sweep_dir, configs, metric)
    return code

"""The run directory: decided once, before any class is built, and written into the config (config.yaml records it).

Every rank parses the command line itself and must agree: torchrun's rendezvous id, SLURM's job id, or under
Lightning's launcher (which re-runs sys.argv for ranks 1..) `--run_dir` appended to sys.argv by rank 0: an
environment variable would stay set for a second run in the process. Nothing here creates a folder.
"""

import errno
import itertools
import json
import os
import pydoc
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from project.errors import ConfigError
from project.loggers import configure_loggers

RUNS_DIR = Path("runs")
# What a fit writes into its run directory (configs/logger/ overlays included)
RUN_FILES = (
    "config.yaml",
    "hparams.yaml",
    "metrics*.csv",
    "events.out.tfevents.*",
    "summary.json",
    "report.png",
)
RUN_FILES += ("resumes.jsonl", "checkpoints", "wandb")
# Keys that name where a run writes, not what it trains: continue_run compares configs without them
LOCATION_KEY = re.compile(r"(^|\.)(run_dir|ckpt_path|default_root_dir|save_dir|dirpath)$")
LIMITS = ("trainer.max_epochs", "trainer.max_steps")  # raising one continues a run (continue_run)
# --ckpt_path values that name no file: Lightning resolves them itself
LIGHTNING_CKPT_NAMES = ("last", "best", "hpc", "registry")


@dataclass(frozen=True)
class RunDir:
    path: Path  # this command's logs, config.yaml, summary.json, report.png
    checkpoints: Path  # where ModelCheckpoint writes and `--ckpt_path last` looks


STARTED: list[RunDir] = []  # run directories that this process's commands created


def checkpoint_run(ckpt_path: str | Path | None) -> Path | None:
    """The run directory of a checkpoint: the newest run's for `last`, the folder above checkpoints/ for a file
    there; None for other paths and for Lightning's `best`, `hpc` and `registry`."""
    if ckpt_path is None:
        return None
    if str(ckpt_path) == "last":
        runs = sorted(RUNS_DIR.glob("*/checkpoints/last*.ckpt"), key=lambda p: p.stat().st_mtime)
        if not runs:
            raise ConfigError(
                f"--ckpt_path last: no run under '{RUNS_DIR}/' has a checkpoints/last.ckpt. "
                "Start a run with `make train`, or pass a checkpoint file: --ckpt_path runs/<run>/checkpoints/last.ckpt."
            )
        return runs[-1].parent.parent
    if "://" in str(ckpt_path):  # object storage holds the checkpoints only: the run is named by --run_dir
        return None
    if str(ckpt_path) not in LIGHTNING_CKPT_NAMES and Path(ckpt_path).parent.name == "checkpoints":
        return Path(ckpt_path).parent.parent
    return None


def resolve_run_dir(run_dir: str | None, ckpt_path: str | None) -> Path:
    """`--run_dir`, else the run of `--ckpt_path`, else the launcher's name for the run, else `runs/<time>`."""
    if run_dir:
        return Path(run_dir)
    if trained := checkpoint_run(ckpt_path):
        return trained
    if name := os.environ.get("TORCHELASTIC_RUN_ID"):  # torchrun's --rdzv_id ("none" unless set)
        if name != "none":
            return RUNS_DIR / name
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ConfigError(
                "Started by torchrun, every process parses the command line on its own and would pick its own "
                "runs/<time> directory. Name the run once for all ranks: use scripts/torchrun.sh --run_id <name> "
                "(runs/<name>), give torchrun --rdzv_id <name>, or pass --run_dir runs/<name> (the same on every node)."
            )
    # SLURM: `runs/slurm-<job id>`, then -1, -2, ... for further runs in the job; a requeued job continues its
    # last (Lightning loads its hpc_ckpt there). Runs in the same second get -1, -2, ...
    job = os.environ.get("SLURM_JOB_ID")
    stamp = f"slurm-{job}" if job else time.strftime("%Y%m%d-%H%M%S")
    candidate, previous, n = RUNS_DIR / stamp, None, 1
    while candidate.exists():
        previous, candidate, n = candidate, RUNS_DIR / f"{stamp}-{n}", n + 1
    requeued = job and int(os.environ.get("SLURM_RESTART_COUNT") or 0) > 0
    return previous if requeued and previous is not None else candidate


def choose(subcommand: str, run_dir: str | None, ckpt_path: str | None) -> RunDir:
    """The run directory of `python -m project <subcommand>`; evaluating a trained run's checkpoint writes into
    <run>/<subcommand>/, leaving the files of its training as they were."""
    path = resolve_run_dir(run_dir, ckpt_path)
    trained = checkpoint_run(ckpt_path) if subcommand != "fit" else None
    if trained is not None and path == trained:
        path = trained / subcommand
    return RunDir(path=path, checkpoints=(trained or path) / "checkpoints")


def prepare(config, subcommand: str, command_line: bool, dump=None) -> RunDir:
    """command_line: the config was parsed from sys.argv, which Lightning's DDP launcher re-runs for ranks 1..;
    dump: the config as config.yaml holds it, for a fit that continues the run in its directory (continue_run)."""
    given = config.get("run_dir")
    run = choose(subcommand, given, config.get("ckpt_path"))
    check_writable(run.path)
    fresh = subcommand == "fit" and dump is not None and not config.get("ckpt_path")
    if not run.path.exists():
        STARTED.append(run)
    config.run_dir = str(run.path)  # recorded in config.yaml
    trainer = config.trainer
    trainer.default_root_dir = str(run.path)
    if isinstance(trainer.logger, list):  # overlays append loggers (configs/logger/)
        trainer.logger = configure_loggers(trainer.logger, run.path)
    from lightning.pytorch.callbacks import ModelCheckpoint

    remote = None
    for callback in trainer.callbacks or []:
        # A fixed folder (not Lightning's version_N) lets `--ckpt_path last` find it.
        if subclass_of(callback.class_path, ModelCheckpoint):
            callback.init_args.dirpath = str(callback.init_args.get("dirpath") or run.checkpoints)
            remote = remote or ("://" in callback.init_args.dirpath and callback.init_args.dirpath)
    if remote:  # checkpoints in object storage: nothing local tells a failed start from a stopped run
        STARTED[:] = [r for r in STARTED if r != run]
    if fresh:  # the newest checkpoint to continue from (hpc_ckpt: Lightning's SLURM requeue)
        ckpt = newest_checkpoint(run, remote)
        continue_run(config, run.path, ckpt, dump) if ckpt else remove_dead_attempt(run.path)
    keep_csv_history(run.path)
    if command_line and not given:
        sys.argv += ["--run_dir", str(run.path)]
    return run


def newest_checkpoint(run: RunDir, remote: str | None) -> str | Path | None:
    if remote:
        from project.checkpoint import filesystem

        return f"{remote}/last.ckpt" if filesystem(remote).isfile(f"{remote}/last.ckpt") else None
    found = [p for p in (run.checkpoints / "last.ckpt", *run.path.glob("hpc_ckpt_*.ckpt")) if p.is_file()]
    return max(found, key=os.path.getmtime, default=None)


def continue_run(config, run: Path, ckpt: Path, dump) -> None:
    """A fit into a run directory that holds a checkpoint continues that run, as `make resume` does: when the
    config is the run's, or raises only max_epochs/max_steps. Any other change is refused; a run that finished
    (fit returned: its limit reached or a callback stopped it, not a signal) is left as it is."""
    from project.checkpoint import read_checkpoint
    from project.distributed import env_rank

    now = flatten(dump())  # another machine continuing from object storage has no config.yaml: its own stands
    saved = (
        flatten(yaml.safe_load((run / "config.yaml").read_text())) if (run / "config.yaml").exists() else now
    )
    changed = [k for k in sorted(saved | now) if saved.get(k) != now.get(k) and not LOCATION_KEY.search(k)]
    limit = lambda v: float("inf") if v in (None, -1) else v  # noqa: E731 - unset: no limit
    raised = [k for k in changed if k in LIMITS and limit(now.get(k)) > limit(saved.get(k))]
    if others := [f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in changed if k not in raised]:
        raise ConfigError(
            f"{run} holds a run started with another config ({'; '.join(others)}), which this command would "
            f'continue from {ckpt}. Nothing was changed. To continue it with this change: make resume ARGS="--ckpt_path '
            f'{ckpt} --<key> <value>" (recorded in its resumes.jsonl); for a new run with this config: --run_dir '
            "runs/<new name>."
        )
    summary = run / "summary.json"
    steps = json.loads(summary.read_text()).get("global_step") if summary.exists() else None
    if not raised and steps == read_checkpoint(ckpt, mmap=True)["global_step"]:
        if env_rank() == 0:
            print(
                f"{run} has finished ({steps} steps); nothing to do. To train on, run this command with a higher "
                "--trainer.max_epochs (or --trainer.max_steps); for a new run, --run_dir runs/<new name>.",
                flush=True,
            )
        raise SystemExit(0)
    config.ckpt_path = str(ckpt)
    record_resume(run, ckpt, [arg for k in raised for arg in (f"--{k}", str(now[k]))])


def flatten(node, prefix: str = "") -> dict:
    """{"a": {"b": [1, {"c": 2}]}} -> {"a.b.0": 1, "a.b.1.c": 2}; empty dicts and lists stay values."""
    if not node or not isinstance(node, dict | list):
        return {prefix: node} if prefix else {}
    items = node.items() if isinstance(node, dict) else enumerate(node)
    return {
        k: v
        for key, value in items
        for k, v in flatten(value, f"{prefix}.{key}" if prefix else str(key)).items()
    }


def remove_dead_attempt(run: Path) -> None:
    """The files of a run that died before its first checkpoint (config.yaml, no summary.json), so that none of
    them mixes into the new run (rank 0)."""
    from project.distributed import env_rank

    if env_rank() == 0 and (run / "config.yaml").is_file() and not (run / "summary.json").exists():
        for path in [p for pattern in RUN_FILES for p in run.glob(pattern)]:
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def record_resume(run: Path, ckpt_path: str, changes: list[str]) -> None:
    """Say that the run continues, and append the command's changes to its resumes.jsonl (rank 0)."""
    from project.distributed import env_rank  # imported here: predict and export must not load lightning

    if env_rank() == 0:
        said = f"; changed by this command: {' '.join(changes)}" if changes else " (no change)"
        print(f"Resuming {run} as it was started: its config.yaml{said}.", flush=True)
        record = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "ckpt_path": str(ckpt_path),
            "changes": changes,
        }
        run.mkdir(parents=True, exist_ok=True)  # a machine continuing from object storage
        with open(run / "resumes.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def discard_if_no_checkpoint() -> None:
    """After a failed command: remove the run directories it created that hold no checkpoint (rank 0)."""
    from project.distributed import env_rank

    while STARTED:
        run = STARTED.pop()
        if env_rank() == 0 and not any(run.checkpoints.glob("*.ckpt")):
            shutil.rmtree(run.path, ignore_errors=True)


def subclass_of(class_path: str, base: type) -> bool:
    cls = pydoc.locate(class_path)  # the parser has imported it
    return isinstance(cls, type) and issubclass(cls, base)


def check_writable(run_dir: Path) -> None:
    """Every rank probes at once, maybe on one shared filesystem: a probe file of its own in the deepest existing
    folder, no folder created or removed (a shared one let a rank delete what another was checking)."""
    existing = next(p for p in (run_dir, *run_dir.parents) if p.exists())
    try:
        if not existing.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(existing))
        handle, probe = tempfile.mkstemp(prefix=".write-test-", dir=existing)
        os.close(handle)
        os.unlink(probe)
    except OSError as err:
        raise ConfigError(
            f"The run directory '{run_dir}' is not writable ({err.strerror or err}): logs and checkpoints go "
            "there. Pass a writable one with --run_dir, or run from a writable working directory."
        ) from err


def keep_csv_history(run_dir: Path) -> None:
    """CSVLogger deletes a metrics.csv it finds: keep it as metrics.<n>.csv (rank 0 only, as CSVLogger writes)."""
    from project.distributed import env_rank

    metrics = run_dir / "metrics.csv"
    if env_rank() == 0 and metrics.exists():
        n = next(n for n in itertools.count(1) if not (run_dir / f"metrics.{n}.csv").exists())
        metrics.rename(run_dir / f"metrics.{n}.csv")

"""The run directory: which one a command uses, that it can be written, and pointing every writer at it.

`python -m project fit|validate|test` decides the directory once, in `prepare` (called by ProjectCLI between parsing
the config and building any class), and writes the answer into the config itself: `run_dir`, the Trainer's
`default_root_dir`, each logger's `save_dir` and each ModelCheckpoint's `dirpath`. Everything downstream reads it
from there: config.yaml records it, and nothing else carries it.

Every rank of a multi-process run parses the command line on its own, so each one must reach the same answer:
- torchrun (scripts/torchrun.sh): `runs/<rendezvous id>`, which every rank of every node reads from torchrun;
- srun (scripts/slurm.sbatch, or any SLURM job): `runs/slurm-<job id>`, which every task reads from SLURM, and
  which a requeued job (same id) finds again, with Lightning's hpc checkpoint in it;
- Lightning's own launcher (`make train-ddp`): it starts ranks 1.. by re-running this process's command line,
  `sys.argv`, so rank 0 appends `--run_dir <its choice>` to sys.argv and the other ranks parse that. The command
  line is the one channel those processes share by construction; an environment variable would also stay set
  in this process, where a second run (a notebook, a test) would then silently reuse the first one's directory.
Nothing here creates a folder: a start that fails (bad config, bad data, an unwritable directory) leaves no empty
run behind for TensorBoard to list. Loggers and checkpoints create the directory when they first write, once
the data has been checked.
"""

import errno
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from project.errors import ConfigError
from project.loggers import configure_loggers

RUNS_DIR = Path("runs")
# --ckpt_path values that name no file: Lightning resolves them itself
LIGHTNING_CKPT_NAMES = ("last", "best", "hpc", "registry")


@dataclass(frozen=True)
class RunDir:
    path: Path  # this command's logs, config.yaml, summary.json, report.png
    checkpoints: Path  # where ModelCheckpoint writes and `--ckpt_path last` looks


STARTED: list[RunDir] = []  # run directories that this process's commands created (discard_if_no_checkpoint)


def checkpoint_run(ckpt_path: str | Path | None) -> Path | None:
    """The run directory a checkpoint belongs to: the newest run's for `last`, the folder above checkpoints/ for a
    file there; None for other paths and for Lightning's `best`, `hpc` and `registry`."""
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
    if str(ckpt_path) not in LIGHTNING_CKPT_NAMES and Path(ckpt_path).parent.name == "checkpoints":
        return Path(ckpt_path).parent.parent
    return None


def resolve_run_dir(run_dir: str | None, ckpt_path: str | None) -> Path:
    """`--run_dir` if given; else the run a `--ckpt_path` belongs to (a resume continues its run); else the name
    the launcher gives every rank; else a new `runs/<YYYYmmdd-HHMMSS>`."""
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
    if job := os.environ.get("SLURM_JOB_ID"):
        return slurm_run_dir(job, requeued=int(os.environ.get("SLURM_RESTART_COUNT") or 0) > 0)
    stamp, n = time.strftime("%Y%m%d-%H%M%S"), 1
    candidate = RUNS_DIR / stamp
    while candidate.exists():  # two runs in the same second get -1, -2, ...
        candidate, n = RUNS_DIR / f"{stamp}-{n}", n + 1
    return candidate


def slurm_run_dir(job: str, requeued: bool) -> Path:
    """`runs/slurm-<job id>`, then `-1`, `-2`, ... for further runs in the same job; a requeued job continues its last.

    Every task of the job answers alike: no rank creates anything before all of them have joined the process group,
    so they all see the same folders. A job that SLURM requeued (after Lightning saved hpc_ckpt_<n>.ckpt on SIGUSR1)
    reruns the same command and must continue its own run, where Lightning then loads that checkpoint itself.
    """
    candidate, previous, n = RUNS_DIR / f"slurm-{job}", None, 1
    while candidate.exists():
        previous, candidate, n = candidate, RUNS_DIR / f"slurm-{job}-{n}", n + 1
    return previous if requeued and previous is not None else candidate


def choose(subcommand: str, run_dir: str | None, ckpt_path: str | None) -> RunDir:
    """The run directory of `python -m project <subcommand>`.

    Evaluating a trained run's checkpoint (validate, test) leaves the run's config.yaml, metrics.csv, summary.json
    and report.png as training wrote them: the evaluation writes its own into <run>/<subcommand>/.
    """
    path = resolve_run_dir(run_dir, ckpt_path)
    trained = checkpoint_run(ckpt_path) if subcommand != "fit" else None
    if trained is not None and path == trained:
        path = trained / subcommand
    return RunDir(path=path, checkpoints=(trained or path) / "checkpoints")


def prepare(config, subcommand: str, command_line: bool) -> RunDir:
    """Decide the run directory of a parsed subcommand config and point the config's writers at it.

    command_line: the config was parsed from sys.argv (not from a list passed in), so Lightning's DDP launcher
    will re-run sys.argv for ranks 1..; see the module docstring.
    """
    given = config.get("run_dir")
    run = choose(subcommand, given, config.get("ckpt_path"))
    check_writable(run.path)
    if not run.path.exists():
        STARTED.append(run)
    config.run_dir = str(run.path)  # recorded in config.yaml
    trainer = config.trainer
    trainer.default_root_dir = str(run.path)
    if isinstance(trainer.logger, list):  # overlays append loggers (configs/logger/)
        trainer.logger = configure_loggers(trainer.logger, run.path)
    for callback in trainer.callbacks or []:
        # A fixed folder (not Lightning's version_N) is what lets `--ckpt_path last` find it.
        if _is_checkpoint(callback.class_path) and callback.init_args.get("dirpath") is None:
            callback.init_args.dirpath = str(run.checkpoints)
    keep_csv_history(run.path)
    if command_line and not given:
        sys.argv += ["--run_dir", str(run.path)]
    return run


def discard_if_no_checkpoint() -> None:
    """After a command that failed: remove the run directories it created that hold no checkpoint, so that no
    half-started run is listed by `make tensorboard` or mixed into the next run (rank 0 removes)."""
    while STARTED:
        run = STARTED.pop()
        if env_rank() == 0 and not any(run.checkpoints.glob("*.ckpt")):
            shutil.rmtree(run.path, ignore_errors=True)


def _is_checkpoint(class_path: str) -> bool:
    import importlib

    from lightning.pytorch.callbacks import ModelCheckpoint

    module, _, name = class_path.rpartition(".")
    cls = getattr(importlib.import_module(module), name, None)
    return isinstance(cls, type) and issubclass(cls, ModelCheckpoint)


def check_writable(run_dir: Path) -> None:
    """Fail before training when the run directory cannot be written; create nothing that stays behind.

    Every rank runs this, at the same moment, on the same directory (and with several nodes, often on one shared
    filesystem). So it creates no folders and removes none: it writes a probe file with a name of its own into the
    run directory, or into its deepest existing parent when the run directory does not exist yet. (A shared probe
    name, or removing the folders it had made, let one rank delete what another was checking: rank 1 then
    failed with "Directory not empty" while rank 0 waited for it until the process group timed out.)
    """
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
    """CSVLogger deletes a metrics.csv it finds in its directory: keep it as metrics.<n>.csv next to the new one
    (the epochs before a resume, or an earlier run or evaluation in the same directory).

    Rank 0 only (CSVLogger writes from rank 0): under torchrun or srun every rank parses the command line at the
    same moment, and two ranks renaming the same file would crash one of them.
    """
    metrics = run_dir / "metrics.csv"
    if env_rank() == 0 and metrics.exists():
        n = 1
        while (run_dir / f"metrics.{n}.csv").exists():
            n += 1
        metrics.rename(run_dir / f"metrics.{n}.csv")


def env_rank() -> int:
    """project.distributed.env_rank, imported when called: predict and export import checkpoint_run from here and
    must not load lightning (project.distributed does)."""
    from project.distributed import env_rank as launcher_rank

    return launcher_rank()

"""The run directory: which one a command uses, that it can be written, and what is kept in it.

Every rank of a multi-process run parses the command line on its own, at the same moment, so everything here
gives all ranks the same answer and is safe to run concurrently.
"""

import errno
import os
import tempfile
import time
from pathlib import Path

from project.distributed import env_rank, launched_externally, launcher_run_name
from project.errors import ConfigError

RUNS_DIR = Path("runs")
RUN_DIR_ENV = "PROJECT_RUN_DIR"  # shared with processes Lightning launches for DDP, so all ranks agree


def checkpoint_run(ckpt_path: str | None) -> Path | None:
    """The run directory a --ckpt_path belongs to: the newest run's for `last`, the folder above checkpoints/ for a
    file there; None for other paths and for Lightning's `best`, `hpc` and `registry`."""
    if ckpt_path == "last":
        runs = sorted(RUNS_DIR.glob("*/checkpoints/last*.ckpt"), key=lambda p: p.stat().st_mtime)
        if not runs:
            raise ConfigError(
                f"--ckpt_path last: no run under '{RUNS_DIR}/' has a checkpoints/last.ckpt. "
                "Start a run with `make train`, or pass a checkpoint file: --ckpt_path runs/<run>/checkpoints/last.ckpt."
            )
        return runs[-1].parent.parent
    if (
        ckpt_path
        and ckpt_path not in ("best", "hpc", "registry")
        and Path(ckpt_path).parent.name == "checkpoints"
    ):
        return Path(ckpt_path).parent.parent
    return None


def resolve_run_dir(run_dir: str | None, ckpt_path: str | None) -> Path:
    if run_dir:
        return Path(run_dir)
    if os.environ.get(RUN_DIR_ENV):
        return Path(os.environ[RUN_DIR_ENV])
    if trained := checkpoint_run(ckpt_path):
        return trained
    # torchrun / srun ranks each parse the command line: they must derive the same directory, not a timestamp.
    if name := launcher_run_name():
        return RUNS_DIR / name
    if launcher := launched_externally():
        raise ConfigError(
            f"Started by {launcher}, every process parses the command line on its own and would pick its own "
            "runs/<time> directory. Name the run once for all ranks: use scripts/torchrun.sh or scripts/slurm.sbatch "
            "(they export PROJECT_RUN_DIR), pass --run_dir runs/<name> (the same on every node), or give torchrun "
            "--rdzv_id <name>."
        )
    # issue #4: a SLURM job requeued after SIGUSR1 (Lightning saved hpc_ckpt_<n>.ckpt into the run dir) reruns
    # the same command; it must continue its own run, where Lightning then loads that checkpoint by itself.
    job = os.environ.get("SLURM_JOB_ID")
    if job and int(os.environ.get("SLURM_RESTART_COUNT") or 0) > 0:
        previous = sorted(RUNS_DIR.glob(f"*-slurm{job}"))
        if previous:
            return previous[-1]
    stamp = time.strftime("%Y%m%d-%H%M%S") + (f"-slurm{job}" if job else "")
    candidate, n = RUNS_DIR / stamp, 1
    while candidate.exists():  # two runs in the same second get -1, -2, ...
        candidate, n = RUNS_DIR / f"{stamp}-{n}", n + 1
    return candidate


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

"""Multi-process runs: the launcher's rank before DDP exists, quiet non-zero ranks, the CPU thread split, and the
one-line world summary. (The run directory all ranks agree on: project/run_dir.py.)"""

import logging
import os
import sys
import warnings

import torch
from lightning.pytorch.utilities import rank_zero_only


def env_rank() -> int:
    """This process's rank as the launcher states it, before any process group exists.

    Lightning reads RANK / LOCAL_RANK / SLURM_PROCID at import; a process of a second node started by Lightning
    itself has only NODE_RANK, so that counts as non-zero too.
    """
    return rank_zero_only.rank or int(os.environ.get("NODE_RANK", "0") or 0)


class _RankFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        # rank_zero_only.rank is the launcher's rank at first, the true global rank once DDP is set up.
        return f"[rank {rank_zero_only.rank or env_rank()}] {record.levelname}: {super().format(record)}"


def quiet_non_zero_ranks() -> None:
    """Rank 0 speaks for the run; other ranks print only warnings and errors, each line prefixed with the rank.

    Python warnings are silenced there: every rank would repeat rank 0's. Uncaught exceptions still print.
    """
    if env_rank() == 0:
        return
    warnings.simplefilter("ignore")
    for name in ("lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.WARNING)
        for handler in logger.handlers:
            handler.setFormatter(_RankFormatter())
    default_hook = sys.excepthook

    def hook(kind, value, traceback) -> None:
        print(
            f"[rank {rank_zero_only.rank or env_rank()}] uncaught {kind.__name__}:",
            file=sys.stderr,
            flush=True,
        )
        default_hook(kind, value, traceback)

    sys.excepthook = hook


def share_cpu_threads(trainer) -> None:
    """CPU DDP: split the cores between this node's processes, unless OMP_NUM_THREADS says otherwise.

    Each process would otherwise run one intra-op thread per core, and processes oversubscribing the cores made a
    run several times slower (2 processes on 2 cores: 300 steps in 135 s, ~40 s with the cores split). (torchrun sets OMP_NUM_THREADS=1 itself when it starts
    several processes per node.)
    """
    if type(trainer.accelerator).__name__ == "CPUAccelerator" and "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // max(1, trainer.num_devices)))


def process_group_backend(strategy) -> str:
    """The process group's backend: the one in use once the group exists, else the one the strategy will ask for.

    Before `trainer.fit` sets up DDP (where the CLI prints the world) no group exists and the strategy's
    `process_group_backend` is None unless configured: Lightning then takes torch's default for the root device
    (`Backend.default_device_backend_map`: gloo on CPU, nccl on CUDA), and gloo for any device it does not list.
    """
    configured = getattr(strategy, "process_group_backend", None)
    if configured:
        return str(configured)
    if not torch.distributed.is_available():
        return "?"
    if torch.distributed.is_initialized():
        return str(torch.distributed.get_backend())
    device = getattr(strategy, "root_device", None)
    if device is None:
        return "?"
    return torch.distributed.Backend.default_device_backend_map.get(device.type, "gloo")


def describe_world(trainer, batch_size: int | None, lr: float | None) -> str:
    """'DDPStrategy: world size 2 = 2 per node x 1 node, CPU processes with gloo (no GPU in use). ...', printed by
    rank 0 before fit."""
    strategy = trainer.strategy
    devices, nodes = trainer.num_devices, trainer.num_nodes
    accelerator = type(trainer.accelerator).__name__.replace("Accelerator", "")
    backend = process_group_backend(strategy)
    where = f"{accelerator} devices, {backend} backend"
    if accelerator == "CPU":
        where = f"CPU processes with {backend} (no GPU in use)"
    lines = [
        f"{type(strategy).__name__}: world size {trainer.world_size} = {devices} per node x {nodes} "
        f"node{'s' if nodes > 1 else ''}, {where}."
    ]
    if batch_size is not None:
        lines.append(
            f"Per-device batch {batch_size}, effective global batch {batch_size * trainer.world_size}."
        )
    if lr is not None:
        lines.append(f"Peak lr {lr:g}.")
    return " ".join(lines)

"""Multi-process runs: the launcher's rank before DDP exists, quiet non-zero ranks, the one-line world summary.
(Lightning's launchers split the CPU threads between a node's processes unless OMP_NUM_THREADS is set.)"""

import logging
import os
import sys
import warnings

import torch
from lightning.pytorch.utilities import rank_zero_only


def env_rank() -> int:
    """This process's rank, also before any process group exists: Lightning reads RANK / LOCAL_RANK / SLURM_PROCID
    at import (the global rank once DDP is set up); a second node's process Lightning started has only NODE_RANK."""
    return rank_zero_only.rank or int(os.environ.get("NODE_RANK", "0") or 0)


def quiet_non_zero_ranks() -> None:
    """Rank 0 speaks for the run; the others print only errors and Lightning's warnings, prefixed with the rank."""
    if env_rank() == 0:
        return
    warnings.simplefilter("ignore")

    class RankFormatter(logging.Formatter):  # env_rank(): the true global rank once DDP is set up
        def format(self, record: logging.LogRecord) -> str:
            return f"[rank {env_rank()}] {record.levelname}: {super().format(record)}"

    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
        for handler in logging.getLogger(name).handlers:
            handler.setFormatter(RankFormatter())
    default_hook = sys.excepthook

    def hook(kind, value, traceback) -> None:
        print(f"[rank {env_rank()}] uncaught {kind.__name__}:", file=sys.stderr, flush=True)
        default_hook(kind, value, traceback)

    sys.excepthook = hook


def process_group_backend(strategy) -> str:
    """The process group's backend: the one in use, else the one the strategy will ask for (torch's default for
    the root device unless configured)."""
    if getattr(strategy, "process_group_backend", None):
        return str(strategy.process_group_backend)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return str(torch.distributed.get_backend())
    return torch.distributed.Backend.default_device_backend_map.get(strategy.root_device.type, "gloo")


def describe_world(trainer, batch_size: int | None, lr: float | None) -> str:
    """'DDPStrategy: world size 2 = 2 per node x 1 node, CPU processes with gloo (no GPU in use). ...'"""
    devices, nodes, world = trainer.num_devices, trainer.num_nodes, trainer.world_size
    accelerator = type(trainer.accelerator).__name__.replace("Accelerator", "")
    backend = process_group_backend(trainer.strategy)
    where = f"{accelerator} devices, {backend} backend"
    where = f"CPU processes with {backend} (no GPU in use)" if accelerator == "CPU" else where
    line = f"{type(trainer.strategy).__name__}: world size {world} = {devices} per node x {nodes} node{'s' * (nodes > 1)}, {where}."
    if batch_size is not None:
        line += f" Per-device batch {batch_size}, effective global batch {batch_size * world}."
    return line + (f" Peak lr {lr:g}." if lr is not None else "")

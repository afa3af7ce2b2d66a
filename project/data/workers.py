"""How many DataLoader worker processes a training process gets when `data.num_workers` is unset."""

from lightning.fabric.utilities.data import suggested_max_num_workers

MAX_DEFAULT_WORKERS = 8


def default_num_workers(reads_files: bool, local_processes: int = 1) -> int:
    """Worker processes per training process.

    Args:
        reads_files: the dataset decodes image files per sample (ImageFolder). Images already decoded into a
            tensor get 0: a worker has no decoding to take off the main process, only the batches' transport,
            and it competes with the main process for the cores (5 digits epochs: 4.5 s with 0 workers, 6.8 s with 1).
        local_processes: training processes on this machine (the Trainer's devices per node).

    Otherwise Lightning's `suggested_max_num_workers`: the CPUs this process may use (its affinity mask) per
    local process, minus one for the process itself, at least 1 (the count Lightning's "does not have many
    workers" hint suggests), and at most 8: Lightning's figure is an upper bound, and each worker is a
    process with its own copy of the dataset object and its prefetched batches (the cap is a choice, not a
    measurement).
    """
    if not reads_files:
        return 0
    return min(MAX_DEFAULT_WORKERS, suggested_max_num_workers(local_processes))

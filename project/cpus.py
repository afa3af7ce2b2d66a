"""The CPUs this process may use: its affinity mask (taskset, a SLURM or container CPU set), not the machine's count.

Lightning reads the same mask for its worker suggestion and its DDP thread split (its private
`lightning.fabric.utilities.data._num_cpus_available`); this is the project's one reader, for what Lightning
does not compute itself.
"""

import os


def usable_cpus() -> int:
    """len(sched_getaffinity) where the OS has it (Linux), else os.cpu_count(), at least 1."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1

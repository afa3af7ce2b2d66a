"""Writing checkpoints: AtomicCheckpointIO, the Trainer plugin (trainer.plugins in configs/default.yaml).

Every checkpoint is written to a temporary file in the same folder, flushed to disk, then renamed over the
target. A crash or kill while writing leaves the previous checkpoint intact; a full disk raises a ConfigError
and also keeps it. Reading checkpoints is project/checkpoint.py: it stays free of Lightning (whose import
takes ~3 s) so that predict and export start fast, which is why this Lightning plugin has a file of its own.
"""

import errno
import os
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from project.atomic import atomic_write, remove_stale
from project.errors import ConfigError, find_in_chain


class AtomicCheckpointIO(TorchCheckpointIO):
    """TorchCheckpointIO whose writes are all-or-nothing (project/atomic.py: temporary file + fsync + os.replace).

    Lightning's stock TorchCheckpointIO (`_atomic_save`) buffers the whole checkpoint in memory and writes it
    through an fsspec transaction: a temporary file in the system's temp folder, then `shutil.move` onto the
    target. When that folder is on another filesystem than the run directory (a tmpfs /tmp, cluster scratch) the
    move is a copy onto the target, not a rename, and nothing is fsynced: a kill or a power loss during it leaves
    a torn last.ckpt where the previous good one was, and a full disk gives no hint. Hence this subclass, which
    keeps the temporary file next to the target; reading is left to the stock class.
    """

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None
    ) -> None:
        path = Path(path)
        opened = False
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_write(path, "wb") as f:
                opened = True
                torch.save(checkpoint, f)
            remove_stale(path)  # left by a process killed mid-write
        except BaseException as err:
            if not opened and isinstance(err, OSError):  # no temporary file could be made: not writable
                raise ConfigError(
                    f"Cannot write checkpoints to '{path.parent}': {err.strerror or err}. "
                    "Make the run directory writable or choose another one with --run_dir."
                ) from err
            error = _disk_error(path, err)
            if error is None:
                raise
            raise error from err


def _disk_error(path: Path, err: BaseException) -> ConfigError | None:
    """A full or read-only disk as a ConfigError that names the fix; None for anything else."""
    # torch's zip writer turns the file's OSError (a full disk inside a tensor) into a RuntimeError
    os_error = find_in_chain(err, OSError)
    if os_error is not None and os_error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES):
        kept = f" The previous '{path.name}' is untouched." if path.exists() else ""
        return ConfigError(
            f"Saving checkpoint '{path}' failed: {os_error.strerror or os_error}.{kept} Free disk space or "
            "point --run_dir at a writable disk with room, then resume with --ckpt_path last."
        )
    return None

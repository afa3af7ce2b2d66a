"""AtomicCheckpointIO, the Trainer plugin that writes every checkpoint (configs/default.yaml's trainer.plugins).

Lightning's TorchCheckpointIO stages the file in the system's temp folder and moves it: an unsynced copy when that
folder is another filesystem (tmpfs /tmp, cluster scratch), so a kill tears last.ckpt. A URL (s3://...) gets each
file in one upload: a key appears only whole. Not in checkpoint.py, which predict and export import without
Lightning."""

import errno
import io
from pathlib import Path

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from project.atomic import atomic_write
from project.checkpoint import filesystem, s3_through_obstore
from project.errors import ConfigError, find_in_chain

s3_through_obstore()  # before ModelCheckpoint or Lightning's loading ask fsspec for an s3:// path


class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        if "://" in str(path):
            buffer = io.BytesIO()
            torch.save(checkpoint, buffer)
            return filesystem(str(path)).pipe_file(str(path), buffer.getvalue())
        path = Path(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_write(path, "wb") as f:
                torch.save(checkpoint, f)
        # torch's zip writer turns a full disk's OSError into a RuntimeError
        except (OSError, RuntimeError) as err:
            cause = find_in_chain(err, OSError)
            if cause is None or cause.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES):
                raise
            kept = f" The previous '{path.name}' is untouched." if path.exists() else ""
            raise ConfigError(
                f"Saving checkpoint '{path}' failed: {cause.strerror or cause}.{kept} Free disk space or point "
                "--run_dir at a writable disk with room, then resume with --ckpt_path last."
            ) from err
        for stale in path.parent.glob(f".{path.name}.*.tmp"):  # left by a process killed mid-write
            stale.unlink(missing_ok=True)

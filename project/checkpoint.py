"""Checkpoint files: atomic writes, safe weight loading, and readable errors for bad files.

- AtomicCheckpointIO (trainer.plugins in configs/default.yaml): every checkpoint is written to a temporary
  file in the same folder, flushed to disk, then renamed over the target. A crash or kill while writing
  leaves the previous checkpoint intact; a full disk raises a ConfigError and also keeps it.
- load_weights(path): for prediction and export. torch.load(weights_only=True) never runs pickled code, so a
  checkpoint from someone else cannot execute anything. Full (pickle) loading is used only by Lightning when
  resuming the user's own run.
- read_checkpoint / check_checkpoint: before resuming, a truncated, foreign or mismatched file is reported
  with its path and what is wrong instead of an unpickling or size-mismatch traceback.
"""

import errno
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch import nn

from project.errors import ConfigError, find_in_chain


class AtomicCheckpointIO(TorchCheckpointIO):
    """TorchCheckpointIO whose writes are all-or-nothing (temporary file + fsync + os.replace)."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None
    ) -> None:
        path = Path(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        except OSError as err:
            raise ConfigError(
                f"Cannot write checkpoints to '{path.parent}': {err.strerror or err}. "
                "Make the run directory writable or choose another one with --run_dir."
            ) from err
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())  # the data is on disk before the rename makes it visible
            os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one, never half
            for stale in path.parent.glob(f".{path.name}.*.tmp"):  # left by a process killed mid-write
                stale.unlink(missing_ok=True)
        except BaseException as err:
            Path(tmp).unlink(missing_ok=True)
            # torch's zip writer turns the file's OSError (a full disk inside a tensor) into a RuntimeError
            os_error = find_in_chain(err, OSError)
            if os_error is not None and os_error.errno in (
                errno.ENOSPC,
                errno.EDQUOT,
                errno.EROFS,
                errno.EACCES,
            ):
                kept = f" The previous '{path.name}' is untouched." if path.exists() else ""
                raise ConfigError(
                    f"Saving checkpoint '{path}' failed: {os_error.strerror or os_error}.{kept} Free disk space or "
                    "point --run_dir at a writable disk with room, then resume with --ckpt_path last."
                ) from err
            raise


def read_checkpoint(path: str | os.PathLike, mmap: bool = False) -> dict:
    """torch.load(weights_only=True) with ConfigErrors that name the file and what is wrong with it.

    mmap=True reads only the index of the file (tensors are mapped lazily): a cheap validity check.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"Checkpoint '{path}' does not exist. Pass an existing .ckpt file to --ckpt_path.")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as err:  # truncated zip, random bytes, a pickle with code in it, ...
        reason = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"Checkpoint '{path}' ({path.stat().st_size} bytes) cannot be read: {reason}. It is truncated, "
            "corrupt, not a PyTorch file, or holds pickled objects that safe (weights_only) loading refuses. "
            "Resume from another checkpoint of the run (see its checkpoints/ folder) or with --ckpt_path last."
        ) from err
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        keys = sorted(checkpoint)[:8] if isinstance(checkpoint, dict) else type(checkpoint).__name__
        raise ConfigError(
            f"'{path}' is a PyTorch file but not a Lightning checkpoint of this template (no 'state_dict'; found "
            f"{keys}). Pass a .ckpt written by `python -m project fit` (runs/<run>/checkpoints/)."
        )
    return checkpoint


def load_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The module's state_dict from a checkpoint, loaded without unpickling code (weights_only=True)."""
    return read_checkpoint(path)["state_dict"]


def check_checkpoint(path: str | os.PathLike, module: nn.Module) -> None:
    """Before resuming: fail clearly if the checkpoint's tensors do not fit `module` (names and shapes)."""
    theirs = {
        k: tuple(v.shape)
        for k, v in read_checkpoint(path, mmap=True)["state_dict"].items()
        if hasattr(v, "shape")
    }
    ours = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    missing = [k for k in ours if k not in theirs]
    unexpected = [k for k in theirs if k not in ours]
    shapes = [
        f"{k}: checkpoint {theirs[k]} vs model {ours[k]}"
        for k in ours
        if k in theirs and theirs[k] != ours[k]
    ]
    if missing or unexpected or shapes:
        parts = []
        if shapes:
            parts.append(f"{len(shapes)} tensors differ in shape ({'; '.join(shapes[:3])})")
        if missing:
            parts.append(f"{len(missing)} of the model's tensors are absent ({', '.join(missing[:3])})")
        if unexpected:
            parts.append(f"{len(unexpected)} tensors are not in the model ({', '.join(unexpected[:3])})")
        raise ConfigError(
            f"Checkpoint '{path}' was written by a different model or for a different number of classes: "
            f"{'; '.join(parts)}. Resume with the config and data the run was started with (its config.yaml: "
            "--config runs/<run>/config.yaml), or start a new run without --ckpt_path."
        )

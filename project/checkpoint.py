"""Checkpoint files: atomic writes, safe weight loading, and readable errors for bad files.

- AtomicCheckpointIO (trainer.plugins in configs/default.yaml): every checkpoint is written to a temporary
  file in the same folder, flushed to disk, then renamed over the target. A crash or kill while writing
  leaves the previous checkpoint intact; a full disk raises a ConfigError and also keeps it.
- load_weights(path): for prediction and export. torch.load(weights_only=True) never runs pickled code, so a
  checkpoint from someone else cannot execute anything. Full (pickle) loading is used only by Lightning when
  resuming the user's own run.
- check_checkpoint(path, module): before resuming, a truncated, foreign or mismatched file is reported with
  its path and what is wrong instead of an unpickling or size-mismatch traceback.
"""

import errno
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch import nn

from project.errors import ConfigError


class AtomicCheckpointIO(TorchCheckpointIO):
    """TorchCheckpointIO whose writes are all-or-nothing (temporary file + fsync + os.replace)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None) -> None:
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
        except BaseException as err:
            Path(tmp).unlink(missing_ok=True)
            if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES):
                kept = f" The previous '{path.name}' is untouched." if path.exists() else ""
                raise ConfigError(
                    f"Saving checkpoint '{path}' failed: {err.strerror or err}.{kept} Free disk space or point "
                    "--run_dir at a writable disk with room, then resume with --ckpt_path last."
                ) from err
            raise


def _load(path: str | os.PathLike, weights_only: bool) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"Checkpoint '{path}' does not exist. Pass an existing .ckpt file to --ckpt_path.")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=weights_only, mmap=False)
    except Exception as err:  # truncated zip, random bytes, a pickle from elsewhere, ...
        reason = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"Checkpoint '{path}' ({path.stat().st_size} bytes) cannot be read: {reason}. It is truncated, "
            "corrupt or not a PyTorch file. Resume from another checkpoint of the run (ls its checkpoints/ folder) "
            "or from --ckpt_path last."
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
    return _load(path, weights_only=True)["state_dict"]


def check_checkpoint(path: str | os.PathLike, module: nn.Module) -> dict:
    """Load a checkpoint for resuming and fail clearly if it does not fit `module`; returns the checkpoint."""
    checkpoint = _load(path, weights_only=False)  # the user's own run: full loading is needed for loops etc.
    theirs, ours = checkpoint["state_dict"], module.state_dict()
    missing = [k for k in ours if k not in theirs]
    unexpected = [k for k in theirs if k not in ours]
    shapes = [
        f"{k}: checkpoint {tuple(theirs[k].shape)} vs model {tuple(ours[k].shape)}"
        for k in ours
        if k in theirs and hasattr(theirs[k], "shape") and tuple(theirs[k].shape) != tuple(ours[k].shape)
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
            f"{'; '.join(parts)}. Resume with the config the run was started with (its config.yaml: "
            "--config runs/<run>/config.yaml), or start a new run without --ckpt_path."
        )
    return checkpoint

"""Checks before training: a corrupt JPEG met in epoch 3, or a label 10 of 10 classes, fails in the first seconds,
in one paragraph naming what, where and the fix."""

from pathlib import Path

import torch
from PIL import Image

from project.errors import ConfigError


def unreadable_reason(path: str | Path) -> str | None:
    """None when PIL can open and verify the file, else why not: its structure without decoding pixels (a JPEG
    truncated inside its pixel data can pass)."""
    try:
        with Image.open(path) as im:
            im.verify()
    except Exception as err:  # PIL raises many types: UnidentifiedImageError, OSError, SyntaxError, ...
        return f"{type(err).__name__}: {str(err)[:80]}"
    return None


def fail_unreadable(bad: list[str], total: int, folder: str | Path) -> None:
    """One error listing the unreadable files ("path (reason)", up to 10, then how many more) of `total`."""
    if bad:
        listed = "; ".join(bad[:10]) + (f"; and {len(bad) - 10} more" if len(bad) > 10 else "")
        raise ConfigError(
            f"{len(bad)} of {total} files under '{folder}' are not readable images: {listed}. Delete or "
            "replace them (class folders may only hold images), then start again. Nothing was trained."
        )


def check_labels(labels: torch.Tensor, num_classes: int, where: str) -> None:
    if len(labels) and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):
        bad = labels[(labels < 0) | (labels >= num_classes)]
        raise ConfigError(
            f"{where} has {len(bad)} labels outside 0..{num_classes - 1} (for example {sorted(set(bad.tolist()))[:5]}), "
            f"but the data module has {num_classes} classes. Fix the labels in the data, or the class list the "
            "data module reports (num_classes comes from it)."
        )


def check_batch_size(n_train: int, world_size: int, batch_size: int) -> None:
    """Every process needs at least one full training batch (the training loaders drop the last partial one)."""
    if n_train // world_size < batch_size:
        per_process = f" ({n_train // world_size} per process)" if world_size > 1 else ""
        raise ConfigError(
            f"The training split has {n_train} samples{per_process}, fewer than data.batch_size={batch_size}; no "
            "full batch would remain. Lower --data.init_args.batch_size."
        )

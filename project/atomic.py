"""Files written whole or not at all: the one way this project writes a file that something else reads back.

A temporary file in the target's own folder (so the rename is a rename, never a copy across filesystems), flushed
and fsynced, then `os.replace`d over the target: atomic on POSIX, so a reader, a kill or a power loss sees the
old file or the new one, never part of one. A failure removes the temporary file and raises. Used for every
file the package writes that something reads back (tests/test_layout.py checks): checkpoints
(project/checkpoint_io.py), summary.json, report.png, the ImageFolder index, prepared datasets' metadata,
exported models, predictions and the sweep's files. Plain Python (no torch or Lightning): the tools that start
fast import it too.
"""

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO


@contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w", **open_args) -> Iterator[IO]:
    """Open a temporary file next to `path` for writing; on a clean exit it replaces `path`.

    mode: "w" (text, utf-8 unless `encoding` is given) or "wb". Raises OSError when the folder cannot be written.
    """
    path = Path(path)
    if "b" not in mode:
        open_args.setdefault("encoding", "utf-8")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode, **open_args) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())  # the data is on disk before the rename makes it visible
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path next to `path`, for a writer that takes a file name rather than a file object (the ONNX
    exporter); on a clean exit the file is fsynced and replaces `path`, as with atomic_write."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """`path` holds `text`, whole (atomic_write)."""
    with atomic_write(path) as f:
        f.write(text)


def remove_stale(path: str | os.PathLike) -> None:
    """Delete temporary files a process killed while writing `path` left behind (atomic_write's names)."""
    path = Path(path)
    for stale in path.parent.glob(f".{path.name}.*.tmp"):
        stale.unlink(missing_ok=True)

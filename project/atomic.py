"""Files written whole or not at all: every file the package writes that something reads back goes through here
(tests/test_layout.py checks), checkpoints included (project/checkpoint_io.py). Plain Python: the tools that start
fast import it."""

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w", **open_args):
    """A temporary file next to `path` ("w": utf-8 text, or "wb"), fsynced, then renamed over `path` on a clean
    exit, so a reader, a kill or a power loss sees the old file or the new one, never part of one. Next to it, so
    that the rename is a rename, not a copy from another filesystem."""
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


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_write(path) as f:
        f.write(text)

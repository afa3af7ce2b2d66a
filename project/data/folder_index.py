"""Index and check an ImageFolder once; later starts re-check only the files that changed.

Without it, every start of every process opened each file of root/<split>/<class>/ (PIL verify) and decoded
up to 512 training images for the normalisation statistics. With it:

- Scan: os.scandir over root/{train,val,test}/<class>/ (recursively, in torchvision ImageFolder's order, so the
  samples, the splits carved from them and the runs are the same as with ImageFolder) gives each image file's
  size and mtime_ns from one stat call. Nothing is opened.
- Manifest (`index.json`): per split, the files' paths (relative to root), sizes and mtime_ns as they were
  when checked; for each file that is not a readable image, why (project/data/validate.py:
  unreadable_reason); the training split's channel mean/std with the caller's key (the image size). A split
  whose three lists equal the scan's is taken whole (three list comparisons: no per-file work in Python);
  otherwise a file whose size and mtime match its entry is not opened again, new or changed files are
  checked, deleted ones drop out. The statistics are recomputed when the training lists or the key change.
  A file rewritten within the same mtime tick with the same size would not be re-checked (the rule make and
  rsync use; mtimes are in nanoseconds on ext4 and xfs).
- Where: `<root>/.project-index/` when the data root is writable: the index stays with the data, and every
  run, user and node of that data shares it. Otherwise `$XDG_CACHE_HOME/project/folder-index/<sha256 of the
  absolute root, 16 hex>/` (default ~/.cache/...): a read-only data folder is never written to. When neither
  can be written, the index is made in memory at each start (as slow as before, never wrong), with a warning.
- One process builds it: the update runs under a file lock (`filelock`, a dependency of torch) next to the
  manifest, and a process that finds the manifest fresh reads it without taking the lock. Lightning calls
  prepare_data on the first process of each node while the node's other processes wait at a barrier, so under
  DDP local rank 0 indexes and the other ranks find the index fresh. The lock is for what that barrier cannot
  see: the first processes of several nodes sharing one data folder, two runs started on the same folder (sweep
  workers), `doctor` next to a run. A trainer barrier would need a process group and order one run's processes
  only. filelock uses flock and falls back to a lock file where the filesystem has no flock; a process killed
  while holding a flock releases it.
- Atomic: the manifest is written to a temporary file in the same folder and renamed over the old one, so a
  reader sees the old or the new manifest, never part of one; an interrupted start leaves the previous one.
"""

import hashlib
import json
import os
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from filelock import FileLock
from torchvision.datasets.folder import IMG_EXTENSIONS

from project.atomic import write_text_atomic
from project.data.image_folder import LAYOUT
from project.data.validate import unreadable_reason
from project.errors import ConfigError

SPLITS = ("train", "val", "test")
LOCAL_DIR = ".project-index"
MANIFEST = "index.json"
VERSION = 2
ANNOUNCE = 10_000  # a start that checks this many files says so on stderr

Stats = Callable[[list[tuple[str, int]]], tuple[list[float], list[float]]]


@dataclass
class FolderIndex:
    """What a start needs from the folder, without opening a file when nothing changed."""

    root: Path
    # split -> (path, class index) in ImageFolder's order; only splits whose folder exists
    samples: dict[str, list[tuple[str, int]]]
    # split -> "path (reason)" of each file that is not a readable image
    unreadable: dict[str, list[str]]
    mean: list[float] | None = None  # training split's channel statistics (None: not asked, or bad files)
    std: list[float] | None = None
    checked: int = 0  # files opened to check them in this call (0 when every verdict came from the manifest)
    manifest: Path | None = None  # where the index is kept (None: nowhere writable, made in memory)
    stats_computed: bool = field(default=False)  # the statistics were computed in this call, not read


def index_folder(
    root: str | Path, classes: list[str], stats: Stats | None = None, stats_key: str = ""
) -> FolderIndex:
    """Scan root's splits, check new or changed files, and (with `stats`) the training split's mean/std.

    classes: the class folder names of root/train (image_folder.describe); val and test must have the same.
    stats: computes (mean, std) from the training samples; called only when the training files or
        `stats_key` changed since the manifest was written, and never while a training file is unreadable.
    """
    root = Path(root)
    scan = _scan(root, classes)
    where = cache_dir(root)
    if where is None:
        warnings.warn(
            f"Neither '{root / LOCAL_DIR}' nor the user cache folder can be written: the ImageFolder index is "
            "made again at every start (every file is checked). Set XDG_CACHE_HOME to a writable folder.",
            stacklevel=2,
        )
        index, _ = _build(root, scan, {}, stats, stats_key, may_work=True)
        return index
    path = where / MANIFEST
    fresh = _build(root, scan, _read(path), stats, stats_key, may_work=False)
    if fresh is not None:  # nothing to check or compute: no lock needed
        fresh[0].manifest = path
        return fresh[0]
    with FileLock(str(where / "index.lock")):
        old = _read(path)  # whoever held the lock before may have done the work
        index, new = _build(root, scan, old, stats, stats_key, may_work=True)
        if new != old:
            _write(path, new)
    index.manifest = path
    return index


def cache_dir(root: str | Path) -> Path | None:
    """`<root>/.project-index` if it can be written, else the user cache folder for root, else None."""
    root = Path(root).resolve()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    digest = hashlib.sha256(str(root).encode()).hexdigest()[:16]
    for folder in (root / LOCAL_DIR, cache / "project" / "folder-index" / digest):
        if _writable(folder):
            return folder
    return None


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:  # PermissionError, read-only filesystem, ...
        return False


def _scan(root: Path, classes: list[str]) -> dict[str, tuple[list[str], list[int], list[int], list[int]]]:
    """split -> (paths relative to root, sizes, mtimes_ns, labels) of its image files, in ImageFolder's order."""
    out = {}
    for split in SPLITS:
        top = root / split
        if not top.is_dir():
            continue
        if split != "train":
            found = sorted(e.name for e in os.scandir(top) if e.is_dir() and not e.name.startswith("."))
            if found != classes:
                raise ConfigError(
                    f"'{top}' has classes {found}, but '{root / 'train'}' has {classes}. "
                    "Every split must have the same class folders."
                )
        rels, sizes, mtimes, labels, empty = [], [], [], [], []
        for label, name in enumerate(classes):
            n = _files(os.path.join(str(top), name), f"{split}/{name}", rels, sizes, mtimes)
            if n == 0:
                empty.append(name)
            labels += [label] * n
        if empty:
            raise ConfigError(
                f"'{top}': Found no valid file for the classes {', '.join(empty)}. Supported extensions are: "
                f"{', '.join(IMG_EXTENSIONS)}. Expected {LAYOUT}."
            )
        out[split] = rels, sizes, mtimes, labels
    return out


def _files(top: str, top_rel: str, rels: list[str], sizes: list[int], mtimes: list[int]) -> int:
    """Append (relative path, size, mtime_ns) of the image files under top, recursively, in ImageFolder's
    order: by folder path, then by file name (it walks sorted(os.walk(top, followlinks=True))). Returns how many."""
    folders, pending = [], [(top, top_rel)]
    while pending:
        folder, rel = pending.pop()
        try:
            entries = sorted(os.scandir(folder), key=_name)
        except OSError:
            continue  # os.walk skips folders it cannot list, and so does ImageFolder
        files = []
        for entry in entries:
            try:
                is_dir = entry.is_dir()  # follows symlinks, as followlinks=True does
            except OSError:
                is_dir = False
            if is_dir:
                pending.append((entry.path, f"{rel}/{entry.name}"))
            elif entry.name.lower().endswith(IMG_EXTENSIONS):
                try:
                    st = entry.stat()
                    files.append((f"{rel}/{entry.name}", st.st_size, st.st_mtime_ns))
                except OSError:  # a broken symlink: listed, and reported unreadable when checked
                    files.append((f"{rel}/{entry.name}", -1, -1))
        folders.append((folder, files))
    folders.sort(key=_name_of_folder)
    n = 0
    for _, files in folders:
        n += len(files)
        for rel, size, mtime in files:
            rels.append(rel)
            sizes.append(size)
            mtimes.append(mtime)
    return n


def _name(entry: os.DirEntry) -> str:
    return entry.name


def _name_of_folder(folder: tuple) -> str:
    return folder[0]


def _build(root: Path, scan: dict, old: dict, stats: Stats | None, stats_key: str, may_work: bool):
    """(FolderIndex, manifest) from the scan and the old manifest; None when may_work is False and a file
    would have to be checked or the statistics computed.

    A split whose (paths, sizes, mtimes) lists equal the manifest's is taken whole, with one list comparison
    each (the usual start: no per-file work in Python); otherwise files are matched one by one.
    """
    old_splits, old_bad = old.get("splits", {}), old.get("bad", {})
    base = str(root).rstrip(os.sep) + os.sep
    manifest = {"version": VERSION, "root": str(root.resolve()), "splits": {}, "bad": {}, "stats": None}
    samples, unreadable, same, checked = {}, {}, {}, 0
    for split, (rels, sizes, mtimes, labels) in scan.items():
        prev = old_splits.get(split) or {}
        same[split] = (
            prev.get("paths") == rels and prev.get("sizes") == sizes and prev.get("mtimes") == mtimes
        )
        if same[split]:
            bad = {rel: why for rel, why in old_bad.items() if rel.startswith(f"{split}/")}
        elif not may_work:
            return None
        else:
            known = dict(zip(prev.get("paths", []), zip(prev.get("sizes", []), prev.get("mtimes", []))))
            todo = sum(known.get(rel) != (size, mtime) for rel, size, mtime in zip(rels, sizes, mtimes))
            if todo >= ANNOUNCE:  # minutes on a large folder: say what is happening, and that it happens once
                print(
                    f"Checking {todo} new or changed image files under '{root / split}' (kept in the index: "
                    "later starts re-check only files that change).",
                    file=sys.stderr,
                    flush=True,
                )
            bad = {}
            for rel, size, mtime in zip(rels, sizes, mtimes):
                if known.get(rel) == (size, mtime):
                    why = old_bad.get(rel)
                else:
                    why, checked = unreadable_reason(base + rel), checked + 1
                if why is not None:
                    bad[rel] = why
        manifest["splits"][split] = {"paths": rels, "sizes": sizes, "mtimes": mtimes}
        manifest["bad"].update(bad)
        samples[split] = list(zip([base + rel for rel in rels], labels))
        unreadable[split] = [f"{base}{rel} ({why})" for rel, why in bad.items()]
    index = FolderIndex(root, samples, unreadable, checked=checked)
    cached = old.get("stats") or {}
    if same["train"] and cached.get("key") == stats_key:
        manifest["stats"] = cached  # still the statistics of these training files
    if stats is not None and not unreadable["train"]:
        if manifest["stats"] is not None:
            index.mean, index.std = cached["mean"], cached["std"]
        elif not may_work:
            return None
        else:
            index.mean, index.std = stats(samples["train"])
            index.stats_computed = True
            manifest["stats"] = {"key": stats_key, "mean": index.mean, "std": index.std}
    return index, manifest


def _read(path: Path) -> dict:
    """The manifest, or {} when it is absent, unreadable or of another version (then it is made again)."""
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) and manifest.get("version") == VERSION else {}


def _write(path: Path, manifest: dict) -> None:
    """Whole or not at all (project/atomic.py): readers see the old or the new manifest."""
    try:
        write_text_atomic(path, json.dumps(manifest, separators=(",", ":")))
    except OSError as err:  # a full disk: this start is correct, the next one checks again
        warnings.warn(f"Could not save the ImageFolder index to '{path}' ({err}).", stacklevel=3)

"""Index and check an ImageFolder once; later starts re-check only the files whose size or mtime_ns changed. The
manifest keeps torchvision's `make_dataset` listing with one stat per file, each unreadable file's reason and the
training statistics. Built under a file lock (Lightning's prepare_data barrier does not cover several nodes or runs
sharing a folder); a fresh one is read without it."""

import hashlib
import json
import os
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock
from torchvision.datasets.folder import IMG_EXTENSIONS, make_dataset

from project.atomic import write_text_atomic
from project.data.image_folder import LAYOUT, class_folders
from project.data.validate import unreadable_reason
from project.errors import ConfigError

SPLITS = ("train", "val", "test")
LOCAL_DIR = ".project-index"
MANIFEST = "index.json"
VERSION = 2


@dataclass
class FolderIndex:
    samples: dict[str, list[tuple[str, int]]]  # split -> (path, class index)
    unreadable: dict[str, list[str]]  # split -> "path (reason)"
    mean: list[float] | None = None  # the training split's statistics
    std: list[float] | None = None
    checked: int = 0  # files opened to check them in this call


def index_folder(
    root: str | Path, classes: list[str], stats: Callable | None = None, stats_key: str = ""
) -> FolderIndex:
    """The splits' samples and unreadable files, and the training split's mean/std from `stats(train samples)`,
    called only when they or `stats_key` changed, never while a training file is unreadable."""
    root = Path(root)
    scan = {split: _scan(root, split, classes) for split in SPLITS if (root / split).is_dir()}
    where = cache_dir(root)
    path = where / MANIFEST
    fresh = _build(root, scan, _read(path), stats, stats_key, may_work=False)
    if fresh is not None:  # nothing to check or compute: no lock needed
        return fresh[0]
    with FileLock(str(where / "index.lock")):
        old = _read(path)  # whoever held the lock before may have done the work
        index, new = _build(root, scan, old, stats, stats_key, may_work=True)
        if new != old:
            _write(path, new)
    return index


def cache_dir(root: str | Path) -> Path:
    """`<root>/.project-index` if it can be written, else the user cache folder for root, else a temporary one."""
    root = Path(root).resolve()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    digest = hashlib.sha256(str(root).encode()).hexdigest()[:16]
    tmp = Path(tempfile.gettempdir(), f"project-folder-index-{digest}")
    for folder in (root / LOCAL_DIR, cache / "project" / "folder-index" / digest, tmp):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=folder):
                return folder
        except OSError:  # PermissionError, a read-only filesystem, ...
            continue
    raise ConfigError(f"No writable folder for the ImageFolder index of '{root}'.")


def _scan(root: Path, split: str, classes: list[str]) -> tuple[list[str], list[int], list[int], list[int]]:
    """(paths relative to root, sizes, mtimes_ns, labels), in ImageFolder's order."""
    top = root / split
    if split != "train" and (found := class_folders(top)) != classes:
        raise ConfigError(
            f"'{top}' has classes {found}, but '{root / 'train'}' has {classes}. "
            "Every split must have the same class folders."
        )
    try:
        samples = make_dataset(str(top), {name: i for i, name in enumerate(classes)}, IMG_EXTENSIONS)
    except FileNotFoundError as err:  # a class folder without images
        raise ConfigError(f"'{top}': {err}. Expected {LAYOUT}.") from err
    start = len(str(root).rstrip(os.sep)) + 1
    stats = [_stat(path) for path, _ in samples]
    rels, labels = [path[start:] for path, _ in samples], [label for _, label in samples]
    return rels, [size for size, _ in stats], [mtime for _, mtime in stats], labels


def _stat(path: str) -> tuple[int, int]:
    try:
        st = os.stat(path)
    except OSError:  # a broken symlink: listed, and reported unreadable when checked
        return -1, -1
    return st.st_size, st.st_mtime_ns


def _build(root: Path, scan: dict, old: dict, stats: Callable | None, stats_key: str, may_work: bool):
    """(FolderIndex, manifest); None when may_work is False and there is work to do."""
    old_splits, old_bad = old.get("splits", {}), old.get("bad", {})
    base = str(root).rstrip(os.sep) + os.sep
    manifest = {"version": VERSION, "root": str(root.resolve()), "splits": {}, "bad": {}, "stats": None}
    index, same = FolderIndex({}, {}), {}
    for split, (rels, sizes, mtimes, labels) in scan.items():
        prev = old_splits.get(split) or {}
        listed = {"paths": rels, "sizes": sizes, "mtimes": mtimes}
        same[split] = all(prev.get(key) == value for key, value in listed.items())
        if same[split]:
            bad = {rel: why for rel, why in old_bad.items() if rel.startswith(f"{split}/")}
        elif not may_work:
            return None
        else:
            known = dict(zip(prev.get("paths", []), zip(prev.get("sizes", []), prev.get("mtimes", []))))
            bad = {}
            for rel, size, mtime in zip(rels, sizes, mtimes):
                if known.get(rel) == (size, mtime):
                    why = old_bad.get(rel)
                else:
                    why, index.checked = unreadable_reason(base + rel), index.checked + 1
                if why is not None:
                    bad[rel] = why
        manifest["splits"][split] = listed
        manifest["bad"].update(bad)
        index.samples[split] = [(base + rel, label) for rel, label in zip(rels, labels)]
        index.unreadable[split] = [f"{base}{rel} ({why})" for rel, why in bad.items()]
    cached = old.get("stats") or {}
    if same["train"] and cached.get("key") == stats_key:
        manifest["stats"] = cached  # still the statistics of these training files
    if stats is not None and not index.unreadable["train"]:
        if manifest["stats"] is None:
            if not may_work:
                return None
            mean, std = stats(index.samples["train"])
            manifest["stats"] = {"key": stats_key, "mean": mean, "std": std}
        index.mean, index.std = manifest["stats"]["mean"], manifest["stats"]["std"]
    return index, manifest


def _read(path: Path) -> dict:
    """The manifest, or {} when it is absent, unreadable or of another version."""
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) and manifest.get("version") == VERSION else {}


def _write(path: Path, manifest: dict) -> None:
    try:  # whole or not at all (project/atomic.py): readers see the old or the new manifest
        write_text_atomic(path, json.dumps(manifest, separators=(",", ":")))
    except OSError as err:  # a full disk: this start is correct, the next one checks again
        warnings.warn(f"Could not save the ImageFolder index to '{path}' ({err}).", stacklevel=3)

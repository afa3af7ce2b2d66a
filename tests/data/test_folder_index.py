"""The ImageFolder index (project/data/folder_index.py): checked once, re-checked where files changed, kept out
of a read-only data folder, built by one process while another waits. In-process, on folders of a few PNGs."""

import os
import shutil
import subprocess
import threading
import time

import pytest
from PIL import Image

from project.data import ImageClassificationDataModule, folder_index, image_folder
from project.errors import ConfigError
from tests.data.test_image_folder import write_pngs

PAST_NS = 1_600_000_000 * 10**9  # every written file gets this mtime, so any rewrite later changes it


def make_folder(root, classes=(("cat", 8), ("dog", 8)), split="train"):
    write_pngs(root, split, dict(classes))
    for path in (root / split).rglob("*.png"):
        os.utime(path, ns=(PAST_NS, PAST_NS))
    return root


def count_calls(monkeypatch, owner, name) -> list:
    """Replace owner.name by a wrapper recording its first argument; returns the record."""
    calls, real = [], getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *a, **k: calls.append(a[0] if a else None) or real(*a, **k))
    return calls


def start(root, **kwargs) -> ImageClassificationDataModule:
    dm = ImageClassificationDataModule(source="imagefolder", root=str(root), batch_size=4, **kwargs)
    dm.prepare_data()  # what a run does before its first log file: setup(), on the first process of a node
    return dm


@pytest.mark.claim("folder-index-reused")
def test_second_start_opens_no_file(tmp_path, monkeypatch):
    root = make_folder(tmp_path / "data")
    first = ImageClassificationDataModule(source="imagefolder", root=str(root), batch_size=4, image_size=8)
    opens = count_calls(monkeypatch, Image, "open")  # PIL: every check and every decode opens through here
    first.prepare_data()
    assert len(opens) >= 16  # the first start checks all 16 files (and decodes them for the statistics)
    assert (root / ".project-index" / "index.json").is_file()

    second = ImageClassificationDataModule(source="imagefolder", root=str(root), batch_size=4, image_size=8)
    opens.clear()  # (constructing the module reads the first image's size: one file, not counted here)
    second.prepare_data()
    assert opens == []  # no file checked again, no image decoded for the statistics: all from the index
    assert (second.mean, second.std) == (first.mean, first.std)
    for split in ("train_set", "val_set", "test_set"):
        a, b = getattr(first, split), getattr(second, split)
        assert a.samples == b.samples
    # the sets still serve images, through the decoder (project/data/image_folder.py)
    reads = count_calls(monkeypatch, image_folder, "load_image")
    x, y = second.train_set[0]
    assert x.shape == (3, 8, 8) and len(reads) == 1

    # another image size needs other statistics: recomputed, but still no file checked
    checks = count_calls(monkeypatch, folder_index, "unreadable_reason")
    start(root, image_size=4)
    assert checks == []


@pytest.mark.claim("folder-index-changes")
def test_changed_added_and_deleted_files_are_noticed(tmp_path, monkeypatch):
    root = make_folder(tmp_path / "data")
    make_folder(root, (("cat", 2), ("dog", 2)), split="val")
    stats = []

    def index():
        return folder_index.index_folder(
            root, ["cat", "dog"], lambda s: stats.append(s) or ([0.5] * 3, [0.2] * 3)
        )

    assert index().checked == 20 and len(stats) == 1  # 16 train + 4 val files, statistics of train
    changed, deleted, added = root / "train/cat/3.png", root / "train/dog/5.png", root / "train/dog/new.png"
    Image.new("RGB", (12, 10), (1, 2, 3)).save(changed)
    deleted.unlink()
    shutil.copy(root / "train/dog/0.png", added)
    checks = count_calls(monkeypatch, folder_index, "unreadable_reason")
    again = index()
    assert sorted(checks) == sorted([str(changed), str(added)]) and again.checked == 2
    assert str(deleted) not in dict(again.samples["train"]) and str(added) in dict(again.samples["train"])
    assert len(stats) == 2 and stats[-1] == again.samples["train"]  # the training files changed: recomputed

    checks.clear()
    Image.new("RGB", (12, 10), (9, 9, 9)).save(root / "val/cat/0.png")
    assert index().checked == 1 and len(stats) == 2  # a val file changed: checked, train statistics kept
    assert index().checked == 0 and len(stats) == 2

    (root / ".project-index/index.json").write_text("{not json")  # a damaged manifest is made again
    assert index().checked == 20 and len(stats) == 3
    leftovers = [p.name for p in (root / ".project-index").iterdir()]
    assert "index.json" in leftovers and not [n for n in leftovers if n.endswith(".tmp")]  # temp file renamed


@pytest.mark.claim("folder-index-unreadable")
def test_unreadable_file_fails_every_start_naming_it_until_removed(tmp_path, monkeypatch):
    root = make_folder(tmp_path / "data")
    broken = root / "train/dog/2.png"
    broken.write_bytes(broken.read_bytes()[:40])  # truncated inside the PNG
    for _ in range(2):  # the second start fails the same way from the cached verdict
        checks = count_calls(monkeypatch, folder_index, "unreadable_reason")
        with pytest.raises(ConfigError) as err:
            start(root)
        assert f"1 of 16 files under '{root / 'train'}' are not readable images: {broken} (" in str(err.value)
        assert "Delete or replace them" in str(err.value) and "Nothing was trained" in str(err.value)
    assert checks == []  # the second time from the index: the file was not opened again
    broken.unlink()
    dm = start(root)
    assert len(dm.train_set) + len(dm.val_set) + len(dm.test_set) == 15 and dm.mean is not None


@pytest.mark.claim("folder-index-read-only")
def test_read_only_data_root_keeps_the_index_in_the_user_cache(tmp_path, monkeypatch):
    root = make_folder(tmp_path / "data")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    with read_only(root):
        dm = start(root)
        checks = count_calls(monkeypatch, folder_index, "unreadable_reason")
        again = start(root)
    assert checks == [] and again.mean == dm.mean  # the second start used the index in the cache
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before  # nothing written under root
    (cache,) = (tmp_path / "cache/project/folder-index").iterdir()  # one folder, named by the root's hash
    assert (cache / "index.json").is_file() and folder_index.cache_dir(root) == root / ".project-index"


class read_only:
    """The folder cannot be written to while inside: mode 0555, or, for root (who ignores modes), the
    immutable attribute (chattr +i)."""

    def __init__(self, folder):
        self.folder, self.immutable = folder, False

    def __enter__(self):
        self.folder.chmod(0o555)
        if os.access(self.folder, os.W_OK):  # root
            subprocess.run(["chattr", "+i", str(self.folder)], check=True, capture_output=True)
            self.immutable = True
        with pytest.raises(OSError):
            (self.folder / "probe").mkdir()
        return self

    def __exit__(self, *exc):
        if self.immutable:
            subprocess.run(["chattr", "-i", str(self.folder)], check=True)
        self.folder.chmod(0o755)


@pytest.mark.claim("folder-index-one-process")
@pytest.mark.timeout(60)
def test_a_second_process_waits_for_the_first_and_checks_nothing(tmp_path, monkeypatch):
    # Two starts at once (two nodes' first processes on one shared folder, or two runs): threads here, which
    # take the file lock through separate file descriptions exactly as two processes do.
    root = make_folder(tmp_path / "data")
    real, release, first_checking = folder_index.unreadable_reason, threading.Event(), threading.Event()
    checked_by: dict[str, int] = {"rank0": 0, "rank1": 0}
    stats_by: dict[str, int] = {"rank0": 0, "rank1": 0}

    def slow_check(path):
        name = threading.current_thread().name
        checked_by[name] += 1
        if name == "rank0":
            first_checking.set()
            assert release.wait(30)  # holds the lock, mid-check, until the other one is seen waiting
        return real(path)

    def stats(samples):
        stats_by[threading.current_thread().name] += 1
        return [0.5] * 3, [0.2] * 3

    monkeypatch.setattr(folder_index, "unreadable_reason", slow_check)
    results = {}

    def run():
        results[threading.current_thread().name] = folder_index.index_folder(root, ["cat", "dog"], stats)

    rank0 = threading.Thread(target=run, name="rank0")
    rank0.start()
    assert first_checking.wait(30)
    rank1 = threading.Thread(target=run, name="rank1")
    rank1.start()
    try:
        time.sleep(0.5)
        assert rank1.is_alive() and checked_by["rank1"] == 0  # waiting on the lock (rank0 cannot finish yet)
    finally:
        release.set()
        rank0.join(30), rank1.join(30)
    assert checked_by == {"rank0": 16, "rank1": 0} and stats_by == {"rank0": 1, "rank1": 0}
    assert results["rank1"].samples == results["rank0"].samples and results["rank1"].checked == 0
    assert results["rank1"].mean == [0.5] * 3

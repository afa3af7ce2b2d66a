"""Data-setup seconds of a run's first and second start on a large ImageFolder (issue 12: second start <= 2 s
for 100,000 files).

Writes 100,000 tiny PNGs (16x16, 10 classes; --quick: 10,000) under runs/bench_data/folder_setup_<n>/ once
(re-used while complete), deletes the folder's index (project/data/folder_index.py), then starts the data module
twice, each in a fresh Python process so that nothing is cached in memory: the first start lists, checks and
takes statistics of the folder and saves the index; the second reads it and re-checks nothing. Timed: the data
module's construction + prepare_data (which runs setup; what `make train` does before the first log file),
without the imports. The files stay in the OS page cache between the two starts (a warm-cache measurement on
both). Prints and returns seconds (wall and CPU).

    python scripts/bench_folder_setup.py [--quick] [--files N]
"""

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLASSES = 10

START = """
import json, sys, time
t0, c0 = time.perf_counter(), time.process_time()
from project.data import ImageClassificationDataModule
from project.data import folder_index
t1, c1 = time.perf_counter(), time.process_time()
dm = ImageClassificationDataModule(source="imagefolder", root=sys.argv[1], batch_size=64)
checked = []
real = folder_index.unreadable_reason
folder_index.unreadable_reason = lambda path: checked.append(path) or real(path)
dm.prepare_data()
t2, c2 = time.perf_counter(), time.process_time()
print(json.dumps({"import_s": t1 - t0, "setup_s": t2 - t1, "setup_cpu_s": c2 - c1, "checked": len(checked),
                  "train": len(dm.train_set), "val": len(dm.val_set), "test": len(dm.test_set)}))
"""


def make_folder(n_files: int) -> Path:
    """n_files PNGs of 16x16 under root/train/<class>/, written once; a marker file says the set is complete."""
    from PIL import Image

    root = ROOT / "runs" / "bench_data" / f"folder_setup_{n_files}"
    done = root / "complete"
    if done.exists():
        return root
    shutil.rmtree(root, ignore_errors=True)
    variants = []  # 16 distinct small images per class, encoded once and written many times
    for c in range(CLASSES):
        per_class = []
        for v in range(16):
            buf = io.BytesIO()
            Image.new("RGB", (16, 16), (25 * c, 16 * v, 255 - 25 * c)).save(buf, format="PNG")
            per_class.append(buf.getvalue())
        variants.append(per_class)
    for c in range(CLASSES):
        folder = root / "train" / f"class{c}"
        folder.mkdir(parents=True)
        for i in range(c, n_files, CLASSES):
            (folder / f"{i:06d}.png").write_bytes(variants[c][i % 16])
    done.write_text(f"{n_files} files\n")
    return root


def start(root: Path) -> dict:
    """One start in a fresh process: the data module's construction + prepare_data, timed inside it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", START, str(root)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(quick: bool, files: int | None = None) -> dict:
    """First and second start's data-setup seconds on a folder of `files` images (default 100,000; quick 10,000)."""
    sys.path.insert(0, str(ROOT))
    from project.data import folder_index

    n = files or (10_000 if quick else 100_000)
    root = make_folder(n)
    cache = folder_index.cache_dir(root)
    if cache is not None:
        shutil.rmtree(cache)  # a first start: no index yet
    first, second = start(root), start(root)
    return {
        "files": n,
        "first_start_s": round(first["setup_s"], 3),
        "second_start_s": round(second["setup_s"], 3),
        "first_start_cpu_s": round(first["setup_cpu_s"], 3),
        "second_start_cpu_s": round(second["setup_cpu_s"], 3),
        "first_checked": first["checked"],
        "second_checked": second["checked"],
        "target_second_start_s": 2.0,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10,000 files instead of 100,000")
    parser.add_argument("--files", type=int, default=None, help="number of files (overrides --quick)")
    args = parser.parse_args()
    print(json.dumps(run(args.quick, args.files), indent=1))

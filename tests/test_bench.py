"""`make bench` smoke test: the bench runs end to end and writes every figure. It asserts no speed."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

SIDE = ["vs_loop", "epoch_pairs", "per_step_overhead_ms", "per_epoch_overhead_ms", "samples_per_s"]
SIDE += ["warmup_epoch_seconds", "loop_samples_per_s", "loop_step_ms"]
KEYS = {
    "template": SIDE,
    "stock_lightning": SIDE,
    "whole_fit": ["epochs", "template_seconds", "loop_seconds", "ratio"],
    "default_run": [
        "train_seconds",
        "test_acc",
        "startup_seconds",
        "import_torch_lightning_seconds",
        "peak_rss_mb",
    ],
    "machine": ["device", "cpus", "precision", "torch", "lightning"],
    "options": ["bf16_mixed"],  # compile: not in the smoke
}


@pytest.mark.claim("bench-smoke")
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_smoke_writes_every_key(tmp_path):
    out = tmp_path / "bench.json"
    # One intra-op thread: on a CI box shared with other jobs, 2 OpenMP threads ran 10x slower.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts/bench.py"), "--smoke", "--out", str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=290,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    for section, keys in KEYS.items():
        assert set(keys) <= set(res[section]), (section, set(keys) - set(res[section]))
    assert res["template_vs_stock_lightning"] > 0 and res["template"]["vs_loop"] > 0
    assert all(v["vs_default"] > 0 for v in res["options"].values())
    assert 0 <= res["default_run"]["test_acc"] <= 1 and res["default_run"]["startup_seconds"] > 0
    assert "| **template ÷ stock Lightning**" in proc.stdout  # the markdown table

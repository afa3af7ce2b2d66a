"""`make bench` smoke test: the bench runs end to end and writes every figure. It asserts no speed."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

KEYS = {
    "throughput": [
        "template_samples_per_s",
        "raw_loop_samples_per_s",
        "throughput_ratio",
        "throughput_ratio_cpu_time",
        "throughput_ratio_vs_tuned_loop",
        "per_step_overhead_ms",
        "per_epoch_overhead_ms",
        "bare_lightning_vs_tuned_loop",
        "bare_lightning_per_step_overhead_ms",
        "bare_lightning_per_epoch_overhead_ms",
        "template_vs_bare_lightning",
        "stock_lightning_vs_tuned_loop",
        "stock_lightning_per_step_overhead_ms",
        "stock_lightning_per_epoch_overhead_ms",
        "template_vs_stock_lightning",
        "epoch_pairs",
        "template_warmup_epoch_seconds",
        "raw_warmup_epoch_seconds",
    ],
    "loader": [
        "dataloader_samples_per_s",
        "in_memory_samples_per_s",
        "in_memory_speedup",
        "model_consumes_samples_per_s",
    ],
    "default_run": [
        "train_seconds",
        "test_acc",
        "startup_seconds",
        "peak_rss_mb",
        "import_torch_lightning_seconds",
        "fit_help_seconds",
        "fit_help_all_seconds",
    ],
    "scaling": ["batch_size", "dataset_size_in_memory_samples_per_s"],
    "machine": ["cpus", "torch", "lightning", "device"],
    "fit": ["template_fit_seconds", "hand_written_loop_seconds", "ratio"],
}
OPTIONS = [
    "no_progress_bar",
    "bf16_mixed",
    "contiguous_nchw",
    "accumulate_grad_batches_2",
    "gradient_clip_val_1",
    "dataloader_path",
    "lightning_profiler",
    "torch_threads_1",
    "compile",
]


@pytest.mark.claim("bench-smoke")
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_smoke_writes_every_key(tmp_path):
    out = tmp_path / "bench.json"
    # One intra-op thread: on a CI box shared with other jobs, 2 OpenMP threads ran 10x slower (see bench.py).
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
    assert set(OPTIONS) <= set(res["options"])
    assert "data_wait_fraction" in res and res["throughput"]["throughput_ratio"] > 0
    assert 0 <= res["progress_bar_hook_fraction"] < 1
    assert res["checkpoint_ms_per_epoch"] > 0  # last.ckpt is written at every steady epoch's end
    assert {"per_step_overhead_ms", "train_metrics_update_ms"} <= set(res["scaling"]["batch_size"]["64"])
    assert 0 <= res["default_run"]["test_acc"] <= 1 and res["default_run"]["startup_seconds"] > 0
    parts = res["default_run"]["startup_parts_seconds"]
    assert list(parts) == [
        "imports_and_parser_setup",
        "parse_and_build",
        "setup",
        "sanity_check_and_first_step",
    ]
    assert all(v >= 0 for v in parts.values())
    assert abs(sum(parts.values()) - res["default_run"]["startup_seconds"]) < 0.05  # the parts add up
    assert "| throughput_ratio" in proc.stdout  # the markdown table

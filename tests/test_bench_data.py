"""`make bench-data` smoke test: scripts/bench_data.py --smoke runs end to end and writes every figure. It asserts
no speed (a smoke run of 2 batches per epoch measures nothing)."""

import importlib.util
import json
import math

import pytest

from tests.conftest import REPO

PATH_KEYS = (
    "train_samples_per_s",
    "epoch_samples_per_s",
    "data_wait_fraction",
    "data_wait_fraction_after_first_batch",
    "warmup_epoch_seconds",
    "samples_per_epoch",
    "loader_workers",
    "train_speed_vs_in_memory",
)


def finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@pytest.mark.claim("bench-data-smoke")
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bench_data_smoke_writes_every_key(tmp_path, capsys):
    # In this process (the bench trains in-process anyway): no new interpreter to import torch and lightning.
    spec = importlib.util.spec_from_file_location("bench_data", REPO / "scripts/bench_data.py")
    bench_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_data)
    out = tmp_path / "bench_data.json"
    bench_data.main(["--smoke", "--out", str(out)])
    res = json.loads(out.read_text())

    assert res["profile"] == "smoke" and finite(res["bench_seconds"])
    machine = res["machine"]
    assert all(machine[k] for k in ("cpu_model", "cpus", "torch", "lightning", "litdata", "date_utc"))
    paths = res["paths"]
    for name in bench_data.PATHS:
        assert all(finite(paths[name][k]) for k in PATH_KEYS), (name, paths[name])
        assert 0 <= paths[name]["data_wait_fraction"] <= 1
    # the same data on every path: as many samples per epoch (2 batches of 64 here)
    assert {paths[name]["samples_per_epoch"] for name in bench_data.PATHS} == {2 * 64}
    assert isinstance(paths["streaming_data_wait_below_target"], bool)
    cpu_keys = ("streaming_read_cpu_ms_per_sample", "train_step_cpu_ms_per_sample", "read_over_step_cpu")
    assert all(finite(paths[k]) and paths[k] > 0 for k in cpu_keys), paths
    # the decode bench (helper module) ran on its tiny smoke folder; the folder bench is skipped and says why
    assert res["decode"]["available"] is True, res["decode"]
    assert any(finite(v) for v in res["decode"].values()), res["decode"]
    assert res["folder_setup"]["available"] is False and "smoke" in res["folder_setup"]["reason"]
    # the markdown table, one row per path
    printed = capsys.readouterr().out
    assert all(f"| {name} |" in printed for name in bench_data.PATHS), printed

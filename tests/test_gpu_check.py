"""The GPU check (scripts/gpu_check.sh) cannot rot: its CPU dry-run runs here, and the pieces it relies on are
tested on their own: the nondeterministic-op paragraph, the hiding of the packages the GPU machine lacks, the
repacked wheels, and `make ... INSTALL=0` (check the environment, install nothing)."""

import json
import os
import subprocess
import sys
import zipfile
from importlib import metadata

import pytest
import torch

from tests.conftest import REPO, launch, user_checkout, user_environment

SCRIPTS = REPO / "scripts"
WHEEL_PACKAGES = ["jsonargparse", "docstring_parser", "typeshed_client"]  # scripts/gpu_check.sh's WHEELS
# The dry-run's own budget (scripts/gpu_check.py BUDGET_S, 290 s) plus the wheels' install: a hung stage fails
# the test through the check's own per-stage caps; this outer limit only catches a hang of the script itself.
DRY_RUN_TIMEOUT = 330
# What `scripts/bench.py` writes (`make bench`'s bench.json; the dry-run's bench stage runs it with --smoke).
SIDE = ["vs_loop", "epoch_pairs", "per_step_overhead_ms", "per_epoch_overhead_ms", "samples_per_s"]
SIDE += ["warmup_epoch_seconds", "loop_samples_per_s", "loop_step_ms"]
BENCH_KEYS = {
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


@pytest.mark.slow
@pytest.mark.timeout(DRY_RUN_TIMEOUT + 30)
@pytest.mark.claim("gpu-check-dry-run", "gpu-check-json", "bench-smoke")
def test_gpu_check_dry_run(tmp_path):
    """`scripts/gpu_check.sh --dry-run` as the README shows it, in a fresh checkout: every stage passes on CPU with
    the GPU machine's missing packages hidden, and each stage's JSON is in runs/gpu_check/. Its bench stage is the
    `make bench` smoke test: `scripts/bench.py --smoke` writes every key and the table (no speed asserted)."""
    checkout = user_checkout(tmp_path / "clone")
    run = launch(
        ["scripts/gpu_check.sh", "--dry-run"], checkout, env={"OMP_NUM_THREADS": "1"}, timeout=DRY_RUN_TIMEOUT
    )
    out = checkout / "runs" / "gpu_check"
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").is_file() else {}
    failed = [s for s in summary.get("stages", []) if not s["passed"]]
    assert run.returncode == 0 and summary.get("passed"), f"{run}\nfailed stages: {failed}"
    stages = {s["stage"] for s in summary["stages"]}
    assert stages == {"environment", "doctor", "fit", "sync_debug", "nondeterministic", "ddp", "bench"}, (
        stages
    )
    for stage in summary["stages"]:  # each stage's JSON is where the summary says
        assert json.loads((out / stage["file"]).read_text())["passed"] is True, stage

    env = json.loads((out / "environment.json").read_text())
    assert env["torch"] == torch.__version__ and summary["torch"] == torch.__version__
    site = env["wheels_installed_into"]
    assert site, "the dry-run installed no wheels"
    for name in WHEEL_PACKAGES:  # imported from the wheels pip installed with --target, not from the venv
        assert env["packages"][name].startswith(site), (name, env["packages"][name])
    assert "pip install" not in run.output or "--no-index" in run.output

    fit = json.loads((out / "fit_probe.json").read_text())
    assert fit["precision"] == "32-true" and fit["train_data_on_device"] is True, fit
    assert fit["batch_on_training_device"] is True, fit
    sync = json.loads((out / "sync_debug.json").read_text())
    assert sync["window"]["steps"] > 0 and sync["syncs"] == [], sync
    ddp = json.loads((out / "ddp_probe.json").read_text())
    assert (ddp["strategy"], ddp["process_group_backend"]) == ("DDPStrategy", "gloo"), ddp
    nondet = json.loads((out / "nondeterministic.json").read_text())
    assert nondet["returncode"] == 2 and "--trainer.deterministic warn" in nondet["error_paragraph"], nondet
    assert nondet["with_deterministic_warn"] == "not run in the dry-run", nondet  # on the GPU only
    bench = json.loads((out / "bench_figures.json").read_text())  # scripts/bench.py --smoke
    assert bench["template"]["samples_per_s"] > 0 and bench["stock_lightning"]["samples_per_s"] > 0, bench
    assert summary["bench"]["template_vs_stock_lightning"] > 0, summary
    for section, keys in BENCH_KEYS.items():
        assert set(keys) <= set(bench[section]), (section, set(keys) - set(bench[section]))
    assert bench["template"]["vs_loop"] > 0 and all(v["vs_default"] > 0 for v in bench["options"].values())
    assert 0 <= bench["default_run"]["test_acc"] <= 1 and bench["default_run"]["startup_seconds"] > 0
    assert "| **template ÷ stock Lightning**" in (out / "bench.out.log").read_text()  # the markdown table


@pytest.mark.claim("nondeterministic-op-error")
def test_nondeterministic_op_is_one_paragraph_naming_the_flag(monkeypatch, capsys):
    """torch's own RuntimeError for an op without a deterministic kernel (the text the CUDA kernels raise, made on
    CPU by torch's helper for it) ends `python -m project fit` in one paragraph naming the flag, exit code 2."""
    from torch._prims_common import alert_not_deterministic

    import project.cli

    def build_cli(args):
        torch.use_deterministic_algorithms(True)  # what Lightning does for trainer.deterministic: true
        try:
            try:
                alert_not_deterministic("adaptive_avg_pool2d_backward_cuda")
            except RuntimeError as err:  # Lightning re-raises from inside its loop: a chained error
                raise RuntimeError("training failed") from err
        finally:
            torch.use_deterministic_algorithms(False)

    monkeypatch.setattr(project.cli, "build_cli", build_cli)
    with pytest.raises(SystemExit) as exit_:
        project.cli.main(["fit"])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2
    assert "\n\n" not in err and "Traceback" not in err, err
    assert (
        err.startswith("error: adaptive_avg_pool2d_backward_cuda ") and "--trainer.deterministic warn" in err
    )


@pytest.mark.claim("gpu-check-wheels")
def test_dry_run_hides_what_the_gpu_machine_lacks(tmp_path):
    """The dry-run's hiding (scripts/gpu_check_site/sitecustomize.py): a hidden package imports only from the
    folder the wheels went into, so a wheel missing from the set fails here as it would on the GPU machine; and a
    repacked wheel (scripts/gpu_check_repack.py) installs with the GPU machine's pip line and imports from there."""
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    py = sys.executable
    subprocess.run([py, SCRIPTS / "gpu_check_repack.py", wheels, "docstring_parser"], check=True)
    (whl,) = wheels.glob("*.whl")
    assert zipfile.ZipFile(whl).testzip() is None
    subprocess.run(
        [py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", site, whl],
        check=True,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )
    env = user_environment() | {
        "GPU_CHECK_HIDE": "docstring_parser jsonargparse",
        "GPU_CHECK_SITE": str(site),
        "PYTHONPATH": f"{SCRIPTS / 'gpu_check_site'}:{site}",
    }
    probe = (
        "import docstring_parser; print(docstring_parser.__file__)\ntry:\n    import jsonargparse\nexcept "
    )
    probe += "ModuleNotFoundError as e:\n    print('hidden:', e.name)"
    got = subprocess.run([py, "-c", probe], env=env, capture_output=True, text=True, check=True).stdout.split(
        "\n"
    )
    assert got[0].startswith(str(site)), got  # from the installed wheel, not from this environment
    assert got[1] == "hidden: jsonargparse", got  # in this environment, but not among the wheels: not found


@pytest.mark.claim("install-check-only")
def test_install_0_checks_instead_of_installing(tmp_path):
    """`make train INSTALL=0` runs the environment check, then trains; no pip install. The check passes on this
    environment and, for a requirement it does not meet (too new a torch, a missing package, a missing extra of
    jsonargparse), names it and the pip command that adds just that."""
    checkout = user_checkout(tmp_path / "clone")
    plan = subprocess.run(
        ["make", "-n", "train", "INSTALL=0"],
        cwd=checkout,
        env=user_environment(),
        capture_output=True,
        text=True,
    )
    lines = plan.stdout.strip().splitlines()
    assert plan.returncode == 0 and len(lines) == 2, plan
    assert lines[0].endswith("python scripts/check_env.py") and " -m project fit " in lines[1], lines
    assert "pip" not in plan.stdout

    ok = subprocess.run([sys.executable, SCRIPTS / "check_env.py"], capture_output=True, text=True)
    assert ok.returncode == 0 and "missing" not in ok.stdout, ok.stdout + ok.stderr
    assert f"ok: torch>=2.6: {metadata.version('torch')}" in ok.stdout  # this env's torch is left as it is

    pyproject = (REPO / "pyproject.toml").read_text().replace('"torch>=2.6"', '"torch>=99"')
    pyproject = pyproject.replace('"rich",', '"rich", "jsonargparse[jsonnet]", "no-such-package-g2>=1",')
    (tmp_path / "pyproject.toml").write_text(pyproject)
    bad = subprocess.run(
        [sys.executable, SCRIPTS / "check_env.py", "--pyproject", tmp_path / "pyproject.toml"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 1, bad
    missing = [line for line in bad.stdout.splitlines() if line.startswith("missing:")]
    assert missing == [
        f"missing: torch>=99: torch {metadata.version('torch')} is installed",
        "missing: jsonnet>=0.21.0: not installed",  # jsonargparse's extra `jsonnet`, not installed here
        "missing: no-such-package-g2>=1: not installed",
    ], bad.stdout
    fix = "-m pip install 'torch>=99' 'jsonargparse[jsonnet]' 'no-such-package-g2>=1'"
    assert fix in bad.stderr, bad.stderr


@pytest.mark.claim("gpu-check-wheels")
def test_wheels_folder_is_git_ignored():
    """--prepare downloads into scripts/gpu_wheels/, which git ignores (the device tool's `carry` takes it)."""
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", "scripts/gpu_wheels/x-1.0-py3-none-any.whl"],
        cwd=REPO,
        capture_output=True,
    )
    assert ignored.returncode == 0


def test_environment_stage_refuses_old_torch():
    """Any torch >= 2.6 (the project's floor) is accepted, an older one is not."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        from gpu_check import FLOOR, _version
    finally:
        sys.path.remove(str(SCRIPTS))
    assert FLOOR == (2, 6)
    assert _version("2.11.0+cu130") >= FLOOR and _version("2.6.0") >= FLOOR and _version("2.14.1") >= FLOOR
    assert _version("2.5.1+cu124") < FLOOR


@pytest.mark.claim("gpu-check-json")
def test_sync_probe_lists_each_sync_with_its_step(tmp_path):
    """The sync window's recorder (gpu_check_probes.Probe), fed the warning torch issues on a GPU under
    set_sync_debug_mode("warn"): a sync at a step that is not a logging step fails the check and is listed with its
    step and stack; one at a logging step is listed and allowed; other warnings pass through untouched."""
    import warnings
    from types import SimpleNamespace

    sys.path.insert(0, str(SCRIPTS))
    try:
        from gpu_check_probes import Probe
    finally:
        sys.path.remove(str(SCRIPTS))
    probe = Probe(str(tmp_path), window_epoch=0, window_start=2, window_steps=3)
    trainer = SimpleNamespace(global_step=2, current_epoch=0, log_every_n_steps=10, is_global_zero=True)
    assert probe._in_window_start(trainer, batch_idx=2) and not probe._in_window_start(trainer, batch_idx=1)
    with warnings.catch_warnings(record=True) as others:
        warnings.simplefilter("always")
        probe._open_window(trainer, torch.device("cpu"))
        warnings.warn("called a synchronizing CUDA operation", stacklevel=1)  # torch's text (c10/cuda)
        warnings.warn("something else", stacklevel=1)
        trainer.global_step = 9  # (9 + 1) % log_every_n_steps == 0: Lightning logs at this step
        warnings.warn("called a synchronizing CUDA operation", stacklevel=1)
        probe._close_window(trainer)
    assert [str(w.message) for w in others] == ["something else"]
    report = json.loads((tmp_path / "sync_debug.json").read_text())
    assert [(s["global_step"], s["logging_step"]) for s in report["syncs"]] == [(2, False), (9, True)], report
    assert report["syncs_outside_logging_steps"] == 1 and report["passed"] is False
    assert any("test_gpu_check.py" in frame for frame in report["syncs"][0]["stack"])
    assert report["detector"] == "none (no CUDA)" and report["canary_caught"] is None

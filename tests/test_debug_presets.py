"""Every debug preset in configs/debug/ runs a short fit and leaves its output in the run directory."""

import pytest

from tests.conftest import CONFIGS, QUIET, read_summary, run_cli

# A few batches are enough to exercise each preset; validation every epoch keeps ModelCheckpoint's monitor fed.
SHORT = [
    "--trainer.max_epochs",
    "1",
    "--trainer.limit_train_batches",
    "3",
    "--trainer.limit_val_batches",
    "1",
    "--trainer.check_val_every_n_epoch",
    "1",
    "--trainer.num_sanity_val_steps",
    "0",
    "--test_after_fit",
    "false",
    "--data.init_args.batch_size",
    "16",
    *QUIET,
]
PRESETS = ["profiler", "profiler_pytorch", "overfit_batches", "detect_anomaly"]


@pytest.mark.parametrize("preset", PRESETS)
def test_debug_preset_runs(preset, in_tmp):
    config = CONFIGS / "debug" / f"{preset}.yaml"
    if not config.exists():
        pytest.skip(f"{config.name} is not in this checkout")
    run = in_tmp / "run"
    assert run_cli("fit", "--config", config, *SHORT, "--run_dir", run) == 0
    assert read_summary(run)["global_step"] > 0
    if preset == "profiler":
        assert "training_step" in (run / "fit-profile.txt").read_text()
    elif preset == "profiler_pytorch":
        assert "Self CPU" in (run / "fit-profile.txt").read_text()
        (trace,) = run.glob("*.pt.trace.json")
        assert trace.stat().st_size > 1000

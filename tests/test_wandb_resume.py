"""W&B alone (`--trainer.logger null` before the overlay, as the README says), offline without a key: metrics
and the report image land in W&B's own files, and a resumed fit (`--ckpt_path last`) continues the same W&B
run, read back from those files."""

import contextlib
import glob
import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.conftest import CONFIGS, read_summary, run_cli
from tests.test_loggers import _wandb_records

pytestmark = pytest.mark.slow  # two fits through the CLI (~8 s)

# `make train ARGS="--trainer.logger null --config configs/logger/wandb.yaml"` on the quick debug config:
# 1 epoch, then `make resume` (= --ckpt_path last) to the config's 2 epochs.
FIT = ["fit", "--config", CONFIGS / "default.yaml", "--trainer.logger", "null",
       "--config", CONFIGS / "logger/wandb.yaml",
       "--config", CONFIGS / "debug/limit_batches.yaml"]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """One W&B-only fit stopped after its first epoch, then resumed to the end; returns the run directory."""
    root = tmp_path_factory.mktemp("wandb_only")
    # W&B's service process may have been started by an earlier W&B run of this test process, in another working
    # directory: the CLI hands W&B an absolute run directory, so this run's files still land in this one.
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        # No key anywhere and no WANDB_MODE: the overlay itself must choose offline mode (README).
        for var in ("WANDB_MODE", "WANDB_API_KEY"):
            mp.delenv(var, raising=False)
        mp.setenv("NETRC", str(root / "no-netrc"))  # where `wandb login` would have saved a key
        for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):  # keep ~ clean
            mp.setenv(var, str(root / "wandb-home"))
        # Were it online after all, it fails here fast instead of waiting on the network.
        mp.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
        mp.setenv("WANDB_INIT_TIMEOUT", "20")  # seconds; bounds only that failure, not a passing run
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            assert run_cli(*FIT, "--trainer.max_epochs", "1") == 0
            (run_dir,) = (root / "runs").iterdir()
            assert read_summary(run_dir)["epochs"] == 1
            # The same process, as a notebook would: the first run left no WANDB_MODE behind to decide this one.
            assert run_cli(*FIT, "--ckpt_path", "last") == 0  # the most recent run, in its own directory
    assert list((root / "runs").iterdir()) == [run_dir]
    hints = [line for line in err.getvalue().splitlines() if "logging offline" in line]
    assert len(hints) == 2 and all(
        f"wandb sync {run_dir.relative_to(root)}/wandb/offline-run-*" in h for h in hints
    ), hints
    return run_dir


def _offline_runs(run_dir: Path) -> list[tuple[str, Path]]:
    """(run id in the folder name, the .wandb file) of each W&B offline run folder, oldest first."""
    folders = sorted(glob.glob(str(run_dir / "wandb/offline-run-*")))  # offline-run-<YYYYmmdd_HHMMSS>-<id>
    return [(f.rsplit("-", 1)[1], Path(next(iter(glob.glob(f + "/run-*.wandb"))))) for f in folders]


@pytest.mark.claim("wandb-alone", "wandb-offline-without-key")
def test_wandb_alone_offline_holds_metrics_and_the_report(runs):
    # W&B is the only logger: no TensorBoard events, no CSV files.
    assert not list(runs.glob("events.out.tfevents.*")) and not list(runs.glob("*.csv"))
    assert not (runs / "hparams.yaml").exists()
    (_, first), (_, second) = _offline_runs(runs)
    for log, epoch in ((first, 0), (second, 1)):
        rows = _history(log)
        assert {"train/loss", "val/acc", "test/acc"} <= set().union(*rows)
        config = {
            i.key
            for r in _wandb_records(log)
            if r.WhichOneof("record_type") == "config"
            for i in r.config.update
        }
        assert {"config", "params"} <= config  # LogConfig's hyperparameters: config.yaml and parameter counts
        assert (
            min(row["epoch"] for row in rows if "epoch" in row) == epoch
        )  # the resumed run starts at epoch 1
        # The report image (drawn once, after the test that follows fit): a media/images entry of the history, and
        # its file.
        images = [row for row in rows if row.get("report/_type") == "images/separated"]
        assert len(images) == 1
    (filename,) = images[-1]["report/filenames"]  # the last one W&B got: drawn after the resumed run's test
    drawn = np.asarray(Image.open(runs / "report.png").convert("RGB"))
    assert np.array_equal(np.asarray(Image.open(second.parent / "files" / filename).convert("RGB")), drawn)


def _history(log: Path) -> list[dict]:
    """The logged rows of a .wandb file: {key ("report/filenames" for nested keys): value}."""
    return [
        {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
        for record in _wandb_records(log)
        if record.WhichOneof("record_type") == "history"
    ]


@pytest.mark.claim("wandb-resume-same-run")
def test_resumed_fit_continues_the_same_wandb_run(runs):
    offline = _offline_runs(runs)
    assert len(offline) == 2  # one W&B process per fit: the first and the resumed one
    ids_in_files = []
    for _, log in offline:
        (run,) = [r.run for r in _wandb_records(log) if r.WhichOneof("record_type") == "run"]
        ids_in_files.append(run.run_id)
    folder_ids = [folder_id for folder_id, _ in offline]
    assert folder_ids[0] == folder_ids[1] == ids_in_files[0] == ids_in_files[1]

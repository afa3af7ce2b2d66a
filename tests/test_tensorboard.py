"""`make tensorboard` on a finished `make train` run: TensorBoard's own server, started as the README shows it (on a
free PORT), queried through its HTTP API the way its web page queries it, and stopped at the end.

What it must serve: the logged scalars (the named learning-rate groups among them), the epoch series ending where
training ended, the test metrics at the last training step, the report image, and the HPARAMS record (the key
hyperparameters with the final metrics). Helpers of LogConfig that need no server are tested at the end.
"""

import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from types import SimpleNamespace

import numpy as np
import pytest
import yaml
from PIL import Image

from project.callbacks.log_config import key_hyperparameters
from tests.conftest import make_argv, read_summary, user_environment

# TensorBoard takes seconds to load a 2-epoch run, tens of seconds on cores shared with other test runs; two
# minutes leave room for a slower machine, and a hang fails instead of blocking.
SERVE_TIMEOUT = 120
# What the default configs log (README "Configuration"), the named groups' learning rates, and the best/* metrics.
SCALARS = {
    "train/loss",
    "train/acc",
    "val/loss",
    "val/acc",
    "val/acc_top5",
    "val/acc_best",
    "test/loss",
    "test/acc",
    "test/acc_top5",
    "lr-AdamW/decay",
    "lr-AdamW/no_decay",
    "epoch",
    "best/val_loss",
    "best/val_acc",
}
KEY_HPARAMS = {"model", "lr", "batch_size", "max_epochs", "seed", "precision", "devices", "nodes"}
HPARAM_METRICS = {"best/val_loss", "best/val_acc", "test/loss", "test/acc", "test/acc_top5"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get(url: str, body: dict | None = None):
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        raw = response.read()
    return raw if response.headers.get_content_type().startswith("image/") else json.loads(raw)


@contextlib.contextmanager
def make_tensorboard(checkout, log):
    """`make tensorboard PORT=<free>` in `checkout`, in a process group of its own; its base URL once it serves."""
    port = _free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [*make_argv("make tensorboard"), f"PORT={port}"],
            cwd=checkout,
            env={**user_environment(), "OMP_NUM_THREADS": "1"},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield f"http://127.0.0.1:{port}", proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)  # make, TensorBoard and its data server
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.slow
@pytest.mark.claim("make-tensorboard", "hparams-in-tensorboard", "epoch-series-ends-with-training")
def test_make_tensorboard_serves_the_run(finished_run, tmp_path):
    run = finished_run.dir.name  # TensorBoard names a run by its folder under --logdir runs
    summary, config = (
        read_summary(finished_run.dir),
        yaml.safe_load((finished_run.dir / "config.yaml").read_text()),
    )
    log = tmp_path / "tensorboard.log"
    with make_tensorboard(finished_run.checkout, log) as (url, proc):
        deadline, tags = time.monotonic() + SERVE_TIMEOUT, {}
        while not SCALARS <= set(tags.get(run, {})) and time.monotonic() < deadline:
            assert proc.poll() is None, f"make tensorboard exited with {proc.returncode}:\n{log.read_text()}"
            time.sleep(1)
            with contextlib.suppress(OSError):  # not listening yet, or still loading
                tags = _get(f"{url}/data/plugin/scalars/tags")
        assert SCALARS <= set(tags.get(run, {})), (
            f"served tags {tags} after {SERVE_TIMEOUT} s:\n{log.read_text()}"
        )
        printed = log.read_text()
        assert f"TensorBoard on runs/: {url}/" in printed  # the Makefile's line: where to point the browser

        def scalars(tag):  # [(step, value)] as the Scalars tab plots them
            return [
                (step, value)
                for _, step, value in _get(f"{url}/data/plugin/scalars/scalars?run={run}&tag={tag}")
            ]

        # The epoch series ends where training ended: last epoch index at the last training step (0-based steps).
        epochs = scalars("epoch")
        assert max(v for _, v in epochs) == summary["epochs"] - 1
        assert max(s for s, _ in epochs) == summary["global_step"] - 1
        # Test metrics: one point each, at the end of training, the value summary.json has (both are the same
        # float32 value: JSON and TensorBoard print it as a double).
        assert scalars("test/acc") == [(summary["global_step"], summary["test_acc"])]
        # Learning rates per named group, once per epoch (LearningRateMonitor's logging_interval: epoch).
        for group in ("decay", "no_decay"):
            assert len(scalars(f"lr-AdamW/{group}")) == summary["epochs"]

        # The report image: the last one logged is report.png, pixel for pixel.
        (last,) = _get(f"{url}/data/plugin/images/images?run={run}&tag=report")[-1:]
        png = _get(f"{url}/data/plugin/images/individualImage?{last['query']}")
        served = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
        assert np.array_equal(served, np.asarray(Image.open(finished_run.dir / "report.png").convert("RGB")))

        # HPARAMS: the key hyperparameters of this run and its final metrics, as the tab requests them.
        experiment = _get(f"{url}/data/plugin/hparams/experiment", {"experimentName": ""})
        assert KEY_HPARAMS <= {h["name"] for h in experiment["hparamInfos"]}
        assert {m["name"]["tag"] for m in experiment["metricInfos"]} == HPARAM_METRICS
        request = {
            "experimentName": "",
            "allowedStatuses": ["STATUS_SUCCESS"],
            "startIndex": 0,
            "sliceSize": 10,
        }
        (group,) = _get(f"{url}/data/plugin/hparams/session_groups", request)["sessionGroups"]
        assert group["name"] == run
        hp = group["hparams"]
        assert hp["model"] == config["model"]["init_args"]["model"]["class_path"].rsplit(".", 1)[-1]
        assert hp["lr"] == config["model"]["init_args"]["optimizer"]["init_args"]["lr"]
        assert hp["batch_size"] == config["data"]["init_args"]["batch_size"]
        assert hp["max_epochs"] == config["trainer"]["max_epochs"] == summary["epochs"]
        assert hp["seed"] == config["seed_everything"] == summary["seed"]
        assert (hp["precision"], hp["devices"], hp["nodes"]) == ("32-true", 1, 1)  # make train on CPU
        metrics = {m["name"]["tag"]: m["value"] for m in group["metricValues"]}
        assert metrics["best/val_loss"] == summary["best_score"]
        assert metrics["best/val_acc"] == summary["best_val_acc"]
        assert {k: metrics[f"test/{k[5:]}"] for k in summary if k.startswith("test_")} == {
            k: v for k, v in summary.items() if k.startswith("test_")
        }


@pytest.mark.claim("hparams-in-tensorboard")
@pytest.mark.parametrize("open_writer", [True, False], ids=["writer-open", "writer-closed"])
def test_the_hparams_record_goes_once_into_the_run_folder_beside_its_scalars(tmp_path, open_writer):
    """The record TensorBoard's HPARAMS tab reads: in the run's own folder (a sub-folder is a second run, without
    the run's scalars), the metrics named but not logged again. After test the SummaryWriter has a file open; at
    fit end without test Lightning may have closed it."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from torch.utils.tensorboard import SummaryWriter

    from project.callbacks.log_config import _write_hparams

    writer = SummaryWriter(tmp_path)
    writer.add_scalar("test/acc", 0.9, 10)
    if not open_writer:
        writer.close()  # as TensorBoardLogger.finalize leaves it
    _write_hparams(writer, {"model": "Net", "lr": 0.01}, {"test/acc": 0.9}, 10)
    writer.close()
    assert all(p.is_file() for p in tmp_path.iterdir()), list(tmp_path.rglob("*"))
    tags = [
        value.tag
        for path in sorted(tmp_path.iterdir())
        for event in EventFileLoader(str(path)).Load()
        for value in event.summary.value
    ]
    assert sorted(tags) == [
        "_hparams_/experiment",
        "_hparams_/session_end_info",
        "_hparams_/session_start_info",
        "test/acc",
    ]


@pytest.mark.claim("hparams-in-tensorboard")
def test_key_hyperparameters_under_short_names():
    config = {
        "seed_everything": 0,
        "model": {"init_args": {"optimizer": {"init_args": {"lr": 0.01}}, "label_smoothing": 0.1}},
        "data": {"init_args": {"batch_size": 64}},
    }
    trainer = SimpleNamespace(max_epochs=3, precision="32-true", num_devices=2, num_nodes=1, optimizers=[])
    module = SimpleNamespace(model=SimpleNamespace())
    params = key_hyperparameters(config, trainer, module)
    assert params == {
        "model": "SimpleNamespace",
        "lr": 0.01,  # the optimizer's init_args.lr
        "batch_size": 64,
        "max_epochs": 3,
        "seed": 0,
        "precision": "32-true",
        "devices": 2,
        "nodes": 1,
    }
    # A module's own `lr` is found too, else the optimizer's.
    config["model"]["init_args"] = {"lr": 0.02}
    assert key_hyperparameters(config, trainer, module)["lr"] == 0.02
    del config["model"]
    trainer.optimizers = [SimpleNamespace(defaults={"lr": 0.03})]
    assert key_hyperparameters(config, trainer, module)["lr"] == 0.03


@pytest.mark.claim("hparams-in-tensorboard")
def test_wandb_gets_the_same_key_hyperparameters(tmp_path_factory):
    """The W&B run (tests/trained_run.py: default configs + limit_batches + the W&B overlay, offline) holds the key
    hyperparameters in its config, and the best/* values in its summary."""
    import glob
    from pathlib import Path

    from project.loggers import wandb_run_id
    from tests.test_loggers import _wandb_records
    from tests.trained_run import trained_run

    run_dir = trained_run(tmp_path_factory)
    summary = read_summary(run_dir)
    run_id = wandb_run_id(run_dir)
    (log,) = glob.glob(str(run_dir / f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"))
    config, final = {}, {}
    for r in _wandb_records(Path(log)):
        kind = r.WhichOneof("record_type")
        if kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in r.config.update if i.key})
        elif kind == "summary":
            final.update({i.key: json.loads(i.value_json) for i in r.summary.update if i.key})
    assert KEY_HPARAMS <= set(config)
    assert (config["max_epochs"], config["seed"]) == (summary["epochs"], summary["seed"])
    assert (
        final["best/val_loss"] == summary["best_score"] and final["best/val_acc"] == summary["best_val_acc"]
    )

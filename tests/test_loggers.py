"""Loggers: TensorBoard, CSV and offline W&B read back with real readers; W&B mode and id; no secrets written."""

import csv
import glob
import itertools
import os
import struct
from pathlib import Path

import pytest
import torch
import yaml
from jsonargparse import Namespace

from project.callbacks.log_config import REDACTED, redact
from project.checkpoint import read_checkpoint
from project.data import ImageClassificationDataModule
from project.inference import build_model
from project.loggers import configure_loggers, configure_wandb, wandb_key_configured, wandb_run_id
from tests.conftest import CONFIGS, read_summary
from tests.trained_run import FAKE_WANDB_KEY, trained_run

# The shared run trains on the quick debug config: its max_epochs and batch limits.
DEBUG = yaml.safe_load((CONFIGS / "debug/limit_batches.yaml").read_text())["trainer"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return trained_run(tmp_path_factory)


@pytest.mark.claim("default-loggers")
def test_tensorboard_events_hold_val_acc(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir)).Reload()
    scalars = acc.Tags()["scalars"]
    assert {"val/acc", "train/loss", "test/acc"} <= set(scalars)
    assert (
        len(acc.Scalars("val/acc")) == read_summary(run_dir)["epochs"] == DEBUG["max_epochs"]
    )  # one per epoch
    assert "report" in acc.Tags()["images"]


@pytest.mark.claim("logged-keys", "default-loggers")
def test_csv_and_hparams(run_dir):
    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
    assert {  # the README's list of logged keys
        "train/loss", "train/acc", "val/loss", "val/acc", "val/acc_top5", "val/acc_best", "test/loss", "test/acc",
        "test/acc_top5", "lr-AdamW/decay", "lr-AdamW/no_decay",
    } <= set(rows[0])  # fmt: skip
    assert any(r.get("val/acc") for r in rows) and any(r.get("test/acc") for r in rows)
    hparams = yaml.full_load((run_dir / "hparams.yaml").read_text())  # has !!python/tuple
    model = build_model(read_checkpoint(run_dir / "checkpoints/last.ckpt"))
    assert (
        hparams["params"]["total"]
        == hparams["params"]["trainable"]
        == sum(p.numel() for p in model.parameters())
    )
    assert hparams["config"]["trainer"]["max_epochs"] == DEBUG["max_epochs"]


@pytest.mark.claim("logged-keys")
def test_logged_accuracy_values_in_metrics_csv(run_dir):
    """val/acc_top5, val/acc_best, test/acc_top5 (README, Configuration), recomputed from the checkpoints."""
    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
    val = [r for r in rows if r.get("val/acc")]
    (test,) = [r for r in rows if r.get("test/acc")]
    assert len(val) == DEBUG["max_epochs"]
    for i, r in enumerate(val):  # the best val/acc so far, epoch by epoch
        assert float(r["val/acc_best"]) == max(float(v["val/acc"]) for v in val[: i + 1])

    # Recomputed on the batches the run evaluated: the last epoch's validation with last.ckpt (the weights it
    # validated), the test with the best checkpoint. Each is k / 128 (2 batches of 64): exact in float32.
    summary = read_summary(run_dir)
    data = ImageClassificationDataModule(
        **yaml.safe_load((run_dir / "config.yaml").read_text())["data"]["init_args"]
    )
    data.setup("fit")
    for ckpt, loader, limit, row, split in (
        (summary["last_checkpoint"], data.val_dataloader(), DEBUG["limit_val_batches"], val[-1], "val"),
        (summary["best_checkpoint"], data.test_dataloader(), DEBUG["limit_test_batches"], test, "test"),
    ):
        module = build_model(read_checkpoint(ckpt))
        top1 = top5 = n = 0
        with torch.inference_mode():
            for batch in itertools.islice(loader, limit):
                x, y = data.on_after_batch_transfer(batch, 0)  # normalised, as evaluation sees it
                top = module(x).topk(5, dim=-1).indices
                top1 += int((top[:, 0] == y).sum())
                top5 += int((top == y[:, None]).any(dim=-1).sum())
                n += len(y)
        assert (float(row[f"{split}/acc"]), float(row[f"{split}/acc_top5"])) == (top1 / n, top5 / n), split
    assert summary["test_acc_top5"] == float(test["test/acc_top5"])


def _wandb_records(path: Path):
    """Records of a W&B transaction log (.wandb): LevelDB log blocks of protobuf `Record`s."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, buf = path.read_bytes(), 7, 32768, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7]) if left >= 7 else (0, 0, 0)
        if length == 0 and kind == 0:  # block padding
            pos += left
            continue
        buf, pos = buf + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # FULL or LAST chunk
            record = pb.Record()
            record.ParseFromString(buf)
            buf = b""
            yield record


@pytest.mark.claim("wandb-offline-without-key")
def test_wandb_offline_run_holds_metrics_and_config(run_dir):
    run_id = wandb_run_id(run_dir)  # read back from W&B's own folder, as a resume does
    (log,) = glob.glob(str(run_dir / f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"))
    metrics, config = set(), {}
    for r in _wandb_records(Path(log)):
        if r.WhichOneof("record_type") == "history":
            metrics |= {i.key or "/".join(i.nested_key) for i in r.history.item}
        elif r.WhichOneof("record_type") == "config":
            config.update({i.key or "/".join(i.nested_key): i.value_json for i in r.config.update})
    assert {"val/acc", "train/loss", "test/acc"} <= metrics
    assert '"total"' in config["params"]
    assert f'"max_epochs":{DEBUG["max_epochs"]}' in config["config"].replace(" ", "")


@pytest.mark.claim("no-secrets")
def test_no_secret_in_run_files(run_dir):
    for path in run_dir.rglob("*"):
        if path.is_file() and path.suffix not in (".ckpt", ".png"):
            assert FAKE_WANDB_KEY.encode() not in path.read_bytes(), path


@pytest.mark.claim("no-secrets")
def test_redact_hides_secret_keys():
    cfg = Namespace(
        logger=[Namespace(class_path="x.NeptuneLogger", init_args=Namespace(api_key="abc", project="p"))]
    )
    out = redact(cfg)
    assert out.logger[0].init_args.api_key == REDACTED and out.logger[0].init_args.project == "p"
    assert cfg.logger[0].init_args.api_key == "abc"  # the original is untouched


@pytest.mark.claim("wandb-offline-without-key", "wandb-resume-same-run")
def test_wandb_offline_without_key_and_same_id_on_reuse(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "absent"))
    assert not wandb_key_configured()
    args = Namespace(offline=False, mode=None, id=None, version=None, save_dir="runs")
    configure_wandb(args, tmp_path / "run")
    # W&B's own mode: Lightning's offline=True would set WANDB_MODE in os.environ for every later run
    assert args.mode == "offline" and args.offline is False and "WANDB_MODE" not in os.environ
    assert "wandb sync" in capsys.readouterr().err
    assert args.save_dir == str(tmp_path / "run")  # absolute: W&B's service resolves it in its own directory
    assert not (tmp_path / "run").exists()  # nothing written before the run starts
    # A resume (the same run dir) reuses the id of the W&B run logged there, found in W&B's own folder.
    (tmp_path / f"run/wandb/offline-run-20261201_101500-{args.id}").mkdir(parents=True)
    resumed = Namespace(offline=False, mode=None, id=None, version=None, save_dir="runs")
    configure_wandb(resumed, tmp_path / "run")
    assert resumed.id == args.id != wandb_run_id(tmp_path / "other")
    (tmp_path / "netrc").write_text("machine api.wandb.ai login user password k3y\n")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert wandb_key_configured()


def test_logger_overlays_combine_without_duplicates(tmp_path):
    def logger(cls, **kw):
        return Namespace(class_path=f"lightning.pytorch.loggers.{cls}", init_args=Namespace(**kw))

    loggers = [logger("TensorBoardLogger", v=1), logger("CSVLogger"), logger("TensorBoardLogger", v=2)]
    out = configure_loggers(loggers, tmp_path)
    assert [x.class_path.rsplit(".", 1)[1] for x in out] == ["TensorBoardLogger", "CSVLogger"]
    assert out[0].init_args.v == 2  # the later overlay's settings win


def test_logger_save_dirs_are_absolute(tmp_path, monkeypatch):
    """TensorBoard appends events from a background thread, resolving a relative path against the working directory
    of that moment; jsonargparse changes it while reading a config file (LogConfig does, after fit), and a run then
    died with FileNotFoundError. Every logger gets the run directory as an absolute path."""
    monkeypatch.chdir(tmp_path)
    loggers = [
        Namespace(class_path=f"lightning.pytorch.loggers.{name}", init_args=Namespace(save_dir="runs"))
        for name in ("TensorBoardLogger", "CSVLogger")
    ]
    for logger in configure_loggers(loggers, Path("runs/r")):
        assert logger.init_args.save_dir == str(tmp_path / "runs" / "r")

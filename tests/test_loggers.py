"""Loggers: TensorBoard, CSV and offline W&B read back with real readers; W&B mode and id; no secrets written."""

import csv
import glob
import struct
from pathlib import Path

import pytest
import yaml
from jsonargparse import Namespace

from project.callbacks.log_config import REDACTED, redact
from project.loggers import configure_loggers, configure_wandb, wandb_key_configured, wandb_run_id
from tests.trained_run import FAKE_WANDB_KEY, trained_run


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return trained_run(tmp_path_factory)


def test_tensorboard_events_hold_val_acc(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir)).Reload()
    scalars = acc.Tags()["scalars"]
    assert {"val/acc", "train/loss", "test/acc"} <= set(scalars)
    assert len(acc.Scalars("val/acc")) == 2  # one per epoch
    assert "report" in acc.Tags()["images"]


@pytest.mark.claim("logged-keys")
def test_csv_and_hparams(run_dir):
    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
    assert {  # the README's list of logged keys
        "train/loss", "train/acc", "val/loss", "val/acc", "val/acc_top5", "val/acc_best", "test/loss", "test/acc",
        "test/acc_top5", "lr-AdamW/pg1", "lr-AdamW/pg2",
    } <= set(rows[0])  # fmt: skip
    assert any(r.get("val/acc") for r in rows) and any(r.get("test/acc") for r in rows)
    hparams = yaml.full_load((run_dir / "hparams.yaml").read_text())  # has !!python/tuple
    assert hparams["params"]["total"] == hparams["params"]["trainable"] > 1000
    assert hparams["config"]["trainer"]["max_epochs"] == 2


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


def test_wandb_offline_run_holds_metrics_and_config(run_dir):
    run_id = (run_dir / "wandb_id.txt").read_text().strip()
    (log,) = glob.glob(str(run_dir / f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"))
    metrics, config = set(), {}
    for r in _wandb_records(Path(log)):
        if r.WhichOneof("record_type") == "history":
            metrics |= {i.key or "/".join(i.nested_key) for i in r.history.item}
        elif r.WhichOneof("record_type") == "config":
            config.update({i.key or "/".join(i.nested_key): i.value_json for i in r.config.update})
    assert {"val/acc", "train/loss", "test/acc"} <= metrics
    assert '"total"' in config["params"] and '"max_epochs":2' in config["config"].replace(" ", "")


def test_no_secret_in_run_files(run_dir):
    for path in run_dir.rglob("*"):
        if path.is_file() and path.suffix not in (".ckpt", ".png"):
            assert FAKE_WANDB_KEY.encode() not in path.read_bytes(), path


def test_redact_hides_secret_keys():
    cfg = Namespace(
        logger=[Namespace(class_path="x.NeptuneLogger", init_args=Namespace(api_key="abc", project="p"))]
    )
    out = redact(cfg)
    assert out.logger[0].init_args.api_key == REDACTED and out.logger[0].init_args.project == "p"
    assert cfg.logger[0].init_args.api_key == "abc"  # the original is untouched


def test_wandb_offline_without_key_and_same_id_on_reuse(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "absent"))
    assert not wandb_key_configured()
    args = Namespace(offline=False, id=None, version=None)
    configure_wandb(args, tmp_path / "run")
    assert args.offline is True and "wandb sync" in capsys.readouterr().err
    assert (
        args.id == wandb_run_id(tmp_path / "run") != wandb_run_id(tmp_path / "other")
    )  # resume reuses the id
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

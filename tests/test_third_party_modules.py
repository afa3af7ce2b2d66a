"""Third-party LightningModules by `--model <class path>`, as a user types them: Lightning's own demos
(lightning.pytorch.demos) and a module written here, with the default callbacks and progress bar.

A module that logs no `val/loss` trains with last.ckpt only, or selects by the key it logs (`--monitor val_loss`),
or stops before training with one paragraph naming what it logs; one without test_step skips the after-fit test;
one that brings its own loaders runs with `--data null`.
"""

import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import read_summary, run_cli

pytestmark = pytest.mark.slow  # every test trains through the CLI

DEMOS = "lightning.pytorch.demos"
SHORT = [
    "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "4", "--trainer.limit_val_batches", "2",
    "--trainer.limit_test_batches", "2", "--run_dir", "run",
]  # fmt: skip
LAST_ONLY = "No best-*.ckpt"  # the line a run without a monitored key prints
NO_TEST = "No test after fit"  # the line a module without test_step prints

# A module of a user's own, logging Lightning's usual flat keys (val_loss, not val/loss).
FLAT_KEYS = """
import torch
from lightning.pytorch.demos.boring_classes import BoringModel


class FlatKeys(BoringModel):
    trained_steps = 0  # how many training steps ran in this process

    def training_step(self, batch, batch_idx):
        FlatKeys.trained_steps += 1
        loss = self.step(batch)
        self.log("train_loss", loss, on_epoch=True, on_step=False)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.step(batch))
        self.log("val_acc", torch.tensor(0.5))

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.step(batch))
        self.log("test_acc", torch.tensor(0.25))
"""


@pytest.fixture(autouse=True)
def lightning_logs_to_pytest(monkeypatch):
    """Lightning's log handlers write to the stderr of the test that imported Lightning (its capsys stream, closed
    after that test: a later record printed a `--- Logging error ---` traceback): to pytest's own."""
    import logging

    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        for handler in logging.getLogger(name).handlers:
            if isinstance(handler, logging.StreamHandler):
                monkeypatch.setattr(handler, "stream", sys.stderr)


@pytest.fixture
def flat_keys(in_tmp, monkeypatch):
    """`--model flat_keys.FlatKeys`: FLAT_KEYS written to a file on sys.path; returns its class."""
    (in_tmp / "flat_keys.py").write_text(FLAT_KEYS)
    monkeypatch.syspath_prepend(str(in_tmp))
    monkeypatch.delitem(sys.modules, "flat_keys", raising=False)
    import flat_keys

    return flat_keys.FlatKeys


def checkpoints(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


def test_boring_model_trains_with_last_checkpoint_only_and_says_so_once(in_tmp, capsys):
    code = run_cli(
        "fit", "--model", f"{DEMOS}.BoringModel", "--data", f"{DEMOS}.BoringDataModule", *SHORT,
        "--trainer.max_epochs", "2",
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert out.count(LAST_ONLY) == 1 and NO_TEST not in out, (
        out
    )  # once in 2 epochs; it has a test_step: tested
    run = in_tmp / "run"
    assert checkpoints(run) == ["last.ckpt"]
    summary = read_summary(run)
    assert (summary["monitor"], summary["best_checkpoint"]) == (None, "")
    assert summary["last_checkpoint"].endswith("last.ckpt") and summary["epochs"] == 2
    assert "best_checkpoint" not in out  # the printed summary leaves the empty value out
    assert (run / "report.png").is_file()


@pytest.mark.claim("resume-same-data")
def test_a_data_module_without_fingerprint_resumes_with_one_warning(in_tmp, capsys):
    boring = ("fit", "--model", f"{DEMOS}.BoringModel", "--data", f"{DEMOS}.BoringDataModule", *SHORT)
    assert run_cli(*boring) == 0
    assert "fingerprint" not in capsys.readouterr().out
    assert (
        run_cli(*boring, "--trainer.max_epochs", "2") == 0
    )  # the same command, one more epoch: it continues
    out = capsys.readouterr().out
    assert "Resuming" in out and out.count("BoringDataModule records no `fingerprint`") == 1, out


def test_demo_model_without_validation_or_test_step_trains(in_tmp, capsys):
    code = run_cli("fit", "--model", f"{DEMOS}.DemoModel", "--data", f"{DEMOS}.BoringDataModule", *SHORT)
    out = capsys.readouterr().out
    assert code == 0
    assert out.count(LAST_ONLY) == 1 and out.count(NO_TEST) == 1, out
    run = in_tmp / "run"
    assert checkpoints(run) == ["last.ckpt"] and read_summary(run)["monitor"] is None
    assert (run / "report.png").is_file()  # drawn at the fit's end: no test follows


def test_lightning_transformer_brings_its_own_loaders_with_data_null(in_tmp, capsys):
    # WikiText2 reads ./data/wikitext-2.txt, downloading it only when it is missing.
    words = [f"w{i}" for i in range(40)]
    text = "\n".join(" ".join(words[(3 * line + j) % 40] for j in range(30)) for line in range(20))
    (in_tmp / "data").mkdir()
    (in_tmp / "data/wikitext-2.txt").write_text(text + "\n")
    code = run_cli(
        "fit", "--model", f"{DEMOS}.LightningTransformer", "--model.init_args.vocab_size", "64", "--data", "null",
        *SHORT,
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert out.count(LAST_ONLY) == 1 and out.count(NO_TEST) == 1, out
    run = in_tmp / "run"
    assert checkpoints(run) == ["last.ckpt"]
    assert read_summary(run)["global_step"] == 4
    assert yaml.safe_load((run / "config.yaml").read_text())["data"] is None  # a resume runs without data too


def test_a_module_logging_val_loss_selects_by_it_with_monitor(flat_keys, in_tmp, capsys):
    code = run_cli("fit", "--model", "flat_keys.FlatKeys", "--data", f"{DEMOS}.BoringDataModule", *SHORT,
                   "--monitor", "val_loss")  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and LAST_ONLY not in out and NO_TEST not in out, out
    run = in_tmp / "run"
    best, last = checkpoints(run)
    assert best.startswith("best-epoch=") and last == "last.ckpt"
    summary = read_summary(run)
    assert summary["monitor"] == "val_loss" and summary["best_checkpoint"].endswith(best)
    assert isinstance(summary["best_score"], float)
    # Flat keys are read as the stage/ ones: test_loss and test_acc, and val_acc as the selected epoch's.
    assert (summary["test_acc"], summary["best_val_acc"]) == (0.25, 0.5) and "test_loss" in summary
    # config.yaml keeps the flag and the callback's monitor: a resume selects by the same key.
    config = yaml.safe_load((run / "config.yaml").read_text())
    (checkpoint,) = [c for c in config["trainer"]["callbacks"] if c["class_path"].endswith("RunCheckpoint")]
    assert config["monitor"] == checkpoint["init_args"]["monitor"] == "val_loss"
    # report.png's curves: the flat keys, recorded as the stage/ ones (the last checkpoint holds them).
    report = torch.load(run / "checkpoints/last.ckpt", weights_only=True)["callbacks"]["RunReport"]
    assert set(report["epochs"][0]) == {"val/loss", "val/acc"}
    # The printed summary and TensorBoard's HPARAMS name the flat keys.
    assert "test_acc" in out and "0.2500" in out
    assert {"best/val_loss", "best/val_acc", "test_loss", "test_acc"} <= hparams_metrics(run)


def hparams_metrics(run: Path) -> set[str]:
    """The metric names of the run's TensorBoard HPARAMS record."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    names = set()
    for path in run.glob("events.out.tfevents.*"):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                if value.tag == "_hparams_/experiment":
                    data = HParamsPluginData.FromString(value.metadata.plugin_data.content)
                    names |= {m.name.tag for m in data.experiment.metric_infos}
    return names


@pytest.mark.parametrize("sanity_steps", ["2", "0"], ids=["sanity-check", "no-sanity-check"])
def test_a_module_not_logging_the_monitored_key_stops_with_one_paragraph(
    flat_keys, in_tmp, capsys, sanity_steps
):
    code = run_cli("fit", "--model", "flat_keys.FlatKeys", "--data", f"{DEMOS}.BoringDataModule", *SHORT,
                   "--trainer.num_sanity_val_steps", sanity_steps)  # fmt: skip
    captured = capsys.readouterr()
    assert code == 2, captured
    error = captured.err.strip().split("\n\n")[-1]
    assert error.startswith("error: ") and "\n" not in error, captured.err
    assert "val_acc, val_loss" in error and "--monitor val_loss" in error and "`val/loss`" in error
    assert "Traceback" not in captured.err + captured.out
    # With the sanity check, before any training step; without one, at the end of the first validation. No
    # checkpoint either way: it would hold an epoch selected by nothing.
    assert flat_keys.trained_steps == (0 if sanity_steps == "2" else 4)
    assert not (in_tmp / "run/checkpoints").exists() or not list((in_tmp / "run/checkpoints").iterdir())

"""RunReport: report.png after fit + test shows the run's curves, learning rates, test confusion matrix and
most confidently wrong test images, rebuilt here from the run's own files; the same image reaches TensorBoard
and W&B."""

import csv
import glob
import io
import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from project.callbacks.report import render, report_figure
from project.checkpoint import read_checkpoint
from project.data import ImageClassificationDataModule
from project.inference import build_model
from tests.trained_run import trained_run

CURVES = ("train/loss", "val/loss", "train/acc", "val/acc")  # README: loss and accuracy per epoch


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return trained_run(tmp_path_factory)


def _expected(run_dir: Path) -> dict:
    """What the report must show, from the run's metrics.csv, checkpoints and data, not from RunReport."""
    summary = json.loads((run_dir / "summary.json").read_text())
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
    epochs: dict[int, dict[str, float]] = {}
    for row in rows:
        for key in CURVES:
            if row.get(key):
                epochs.setdefault(int(row["epoch"]), {})[key] = float(row[key])
    # Learning rates per step: RunReport's record in last.ckpt, checked against LearningRateMonitor's
    # (one per epoch start).
    lrs_by_step = read_checkpoint(summary["last_checkpoint"])["callbacks"]["RunReport"]["lrs"]
    assert sorted(lrs_by_step) == list(range(summary["global_step"]))
    monitored = [r for r in rows if r.get("lr-AdamW/decay")]
    assert len(monitored) == summary["epochs"]
    for row in monitored:
        groups = ("decay", "no_decay")  # the module's named parameter groups
        assert lrs_by_step[int(row["step"])] == [float(row[f"lr-AdamW/{g}"]) for g in groups]

    # The test stage's predictions: the best checkpoint on the run's test batches, through its test_step.
    data = ImageClassificationDataModule(**config["data"]["init_args"])
    data.setup("test")
    module = build_model(read_checkpoint(summary["best_checkpoint"]))
    module.setup("test")  # channels_last, as in the run
    n = len(data.class_names)
    confusion, wrong = np.zeros((n, n), dtype=np.int64), []
    with torch.inference_mode():
        batches = itertools.islice(data.test_dataloader(), config["trainer"]["limit_test_batches"])
        for i, (x, y) in enumerate(batches):
            conf, pred = module.test_step((x, y), i).softmax(dim=-1).max(dim=-1)
            np.add.at(confusion, (y.numpy(), pred.numpy()), 1)
            wrong += [
                (float(conf[j]), x[j], int(pred[j]), int(y[j])) for j in torch.nonzero(pred != y).flatten()
            ]
    (report,) = [c for c in config["trainer"]["callbacks"] if c["class_path"].endswith("RunReport")]
    return {
        "epochs": epochs,
        "lrs": [lrs_by_step[s] for s in sorted(lrs_by_step)],
        "confusion": torch.from_numpy(confusion),
        "wrong": sorted(wrong, key=lambda w: -w[0])[: report["init_args"]["num_wrong"]],  # most confident 1st
        "class_names": data.class_names,
        "dpi": report["init_args"]["dpi"],
        "test_acc": summary["test_acc"],
    }


def _texts(ax) -> list[str]:
    return [t.get_text() for t in ax.texts]


@pytest.mark.claim("run-report")
def test_report_shows_the_run(run_dir):
    exp = _expected(run_dir)
    args = (exp["epochs"], exp["lrs"], exp["confusion"], exp["wrong"], exp["class_names"], exp["dpi"])
    # report.png is, pixel for pixel, the report of this data: drawn from nothing else.
    drawn = np.asarray(Image.open(run_dir / "report.png").convert("RGB"))
    expected = render(*args)
    assert drawn.shape == expected.shape
    assert np.array_equal(drawn, expected), f"{(drawn != expected).any(axis=-1).sum()} pixels differ"

    # ...and that report shows what the README lists (read from the figure's axes, not its pixels).
    fig = report_figure(*args)
    ax_loss, ax_acc, ax_lr = fig.subfigs[0].axes
    for ax, metric in ((ax_loss, "loss"), (ax_acc, "acc")):
        assert ax.get_title() == f"{metric} per epoch" and ax.get_xlabel() == "epoch"
        lines = {line.get_label(): line for line in ax.lines}
        assert sorted(lines) == ["train", "val"]
        for split, line in lines.items():
            points = [(e, v[f"{split}/{metric}"]) for e, v in sorted(exp["epochs"].items())]
            assert len(points) == json.loads((run_dir / "summary.json").read_text())["epochs"]
            assert list(zip(line.get_xdata(), line.get_ydata(), strict=True)) == points
    assert ax_lr.get_title() == "learning rate per step"
    assert [list(line.get_ydata()) for line in ax_lr.lines] == [
        list(s) for s in zip(*exp["lrs"], strict=True)
    ]

    ax_cm, ax_wrong = fig.subfigs[1].axes
    cm = exp["confusion"].numpy()
    assert np.trace(cm) / cm.sum() == exp["test_acc"]  # the matrix is the test stage's: summary.json agrees
    assert np.array_equal(ax_cm.images[0].get_array(), cm)
    assert _texts(ax_cm) == [str(v) for v in cm.flatten()]  # every cell's count is written in it
    assert [t.get_text() for t in ax_cm.get_xticklabels()] == exp["class_names"]
    assert [t.get_text() for t in ax_cm.get_yticklabels()] == exp["class_names"]
    assert (ax_cm.get_xlabel(), ax_cm.get_ylabel()) == ("predicted", "true")
    assert f"accuracy {exp['test_acc']:.1%}" in ax_cm.get_title()
    assert ax_wrong.get_title().startswith("most confidently wrong test images")
    names = exp["class_names"]
    assert _texts(ax_wrong) == [f"{names[p]} / {names[t]} ({c:.0%})" for c, _, p, t in exp["wrong"]]


@pytest.mark.claim("report-in-loggers")
def test_report_same_image_in_tensorboard_and_wandb(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    drawn = np.asarray(Image.open(run_dir / "report.png").convert("RGB"))
    events = EventAccumulator(str(run_dir), size_guidance={"images": 0}).Reload().Images("report")
    assert len(events) == 2  # after fit and after test
    last_tb = np.asarray(Image.open(io.BytesIO(events[-1].encoded_image_string)).convert("RGB"))
    assert np.array_equal(last_tb, drawn)
    from project.loggers import wandb_run_id  # the id W&B's own folder under the run dir records

    run_id = wandb_run_id(run_dir)
    media = glob.glob(str(run_dir / f"wandb/offline-run-*-{run_id}/files/media/images/report_*.png"))
    assert len(media) == 2  # W&B names each image report_<its step>_<hash>.png
    last_wandb = max(media, key=lambda p: int(Path(p).name.split("_")[1]))
    assert np.array_equal(np.asarray(Image.open(last_wandb).convert("RGB")), drawn)


def test_report_works_without_test_results():
    epochs = {0: {"train/loss": 2.0, "val/loss": 1.9}, 1: {"train/loss": 1.5}}
    image = render(epochs, [[0.1], [0.2]], None, [], None, 50)
    assert image.shape == (500, 750, 3)  # 15 x 10 inches at dpi 50
    fig = report_figure(epochs, [[0.1], [0.2]], None, [], None, 50)
    ax_loss, ax_acc, ax_lr = fig.subfigs[0].axes
    lines = {line.get_label(): list(line.get_xdata()) for line in ax_loss.lines}
    assert lines == {"train": [0, 1], "val": [0]}
    assert _texts(ax_acc) == ["no epochs logged"]
    assert [list(line.get_ydata()) for line in ax_lr.lines] == [[0.1, 0.2]]
    ax_cm, ax_wrong = fig.subfigs[1].axes
    assert _texts(ax_cm) == ["confusion matrix: after test"] and not ax_cm.images
    assert ax_wrong.get_title() == "no wrong test images"


def test_report_history_survives_checkpoint_restore():
    from project.callbacks.report import RunReport

    resumed = RunReport()  # a resumed fit: the checkpoint holds epochs 0-1, this process adds epoch 2
    resumed.load_state_dict(
        {"epochs": {0: {"val/acc": 0.1}, 1: {"val/acc": 0.2}}, "lrs": {0: [1e-3], 5: [2e-3]}}
    )
    resumed.epochs[2], resumed.lrs[10] = {"val/acc": 0.3}, [1e-4]
    state = resumed.state_dict()
    assert sorted(state["epochs"]) == [0, 1, 2] and sorted(state["lrs"]) == [0, 5, 10]
    # The test after fit restores the best (earlier) checkpoint: the epochs seen in this process win.
    resumed.load_state_dict({"epochs": {0: {"val/acc": 0.1}}, "lrs": {0: [1e-3]}})
    assert resumed.state_dict()["epochs"][2] == {"val/acc": 0.3}

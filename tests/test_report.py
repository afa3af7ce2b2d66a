"""RunReport: report.png after fit + test (drawn once, after the test) shows the run's curves, learning rates, test confusion matrix and
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
    recorded = read_checkpoint(summary["last_checkpoint"])["callbacks"]["RunReport"]
    # Two tensors, not a {step: [lr, ...]} mapping: a checkpoint's size in pickled objects must not grow with the run.
    assert recorded["lr_steps"].dtype == torch.int64 and recorded["lr_values"].dtype == torch.float64
    lrs_by_step = dict(zip(recorded["lr_steps"].tolist(), recorded["lr_values"].tolist(), strict=True))
    groups = recorded["lr_names"]
    assert groups == [
        "decay",
        "no_decay",
    ]  # the module's named parameter groups, as LearningRateMonitor tags them
    assert sorted(lrs_by_step) == list(range(summary["global_step"]))
    monitored = [r for r in rows if r.get("lr-AdamW/decay")]
    assert len(monitored) == summary["epochs"]
    for row in monitored:
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
        for i, batch in enumerate(batches):
            x, y = data.on_after_batch_transfer(batch, 0)  # normalised, as the run's test stage saw it
            conf, pred = module.test_step((x, y), i).softmax(dim=-1).max(dim=-1)
            np.add.at(confusion, (y.numpy(), pred.numpy()), 1)
            wrong += [
                (float(conf[j]), x[j], int(pred[j]), int(y[j])) for j in torch.nonzero(pred != y).flatten()
            ]
    (report,) = [c for c in config["trainer"]["callbacks"] if c["class_path"].endswith("RunReport")]
    return {
        "epochs": epochs,
        "lrs": [lrs_by_step[s] for s in sorted(lrs_by_step)],
        "lr_names": groups,
        "confusion": torch.from_numpy(confusion),
        "wrong": sorted(wrong, key=lambda w: -w[0])[: report["init_args"]["num_wrong"]],  # most confident 1st
        "class_names": data.class_names,
        "dpi": report["init_args"]["dpi"],
        "test_acc": summary["test_acc"],
    }


def _texts(ax) -> list[str]:
    return [t.get_text() for t in ax.texts]


def _panels(fig):
    """(confusion-matrix axes, wrong-images subfigure, its images, their captions): report_figure's documented
    layout, one axes holding every wrong image (an AxesImage) and its caption (a text)."""
    left, right = fig.subfigs[1].subfigs
    assert len(right.axes) <= 1
    images = [image for ax in right.axes for image in ax.images]
    return left.axes[0], right, images, [text for ax in right.axes for text in ax.texts]


def _assert_lr_lines(ax_lr, lrs, names) -> None:
    """Every group's series is drawn, by one line labelled with its name; equal series share a line (labelled
    with all their names) instead of hiding one under the other."""
    series = dict(zip(names, zip(*lrs, strict=True), strict=True))
    drawn = {line.get_label(): list(line.get_ydata()) for line in ax_lr.lines}
    assert sorted(n for label in drawn for n in label.split(", ")) == sorted(names)  # each name once
    for label, ys in drawn.items():
        assert all(list(series[n]) == ys for n in label.split(", ")), label
    assert len(drawn) == len(set(series.values()))  # one line per distinct series


@pytest.mark.claim("run-report")
def test_report_shows_the_run(run_dir):
    exp = _expected(run_dir)
    args = (
        exp["epochs"],
        exp["lrs"],
        exp["confusion"],
        exp["wrong"],
        exp["class_names"],
        exp["dpi"],
        exp["lr_names"],
    )
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
    _assert_lr_lines(ax_lr, exp["lrs"], exp["lr_names"])
    assert [line.get_label() for line in ax_lr.lines] == ["decay, no_decay"]  # the default run: equal rates

    ax_cm, wrong_panel, tiles, captions = _panels(fig)
    cm = exp["confusion"].numpy()
    assert np.trace(cm) / cm.sum() == exp["test_acc"]  # the matrix is the test stage's: summary.json agrees
    assert np.array_equal(ax_cm.images[0].get_array(), cm)
    assert _texts(ax_cm) == [str(v) for v in cm.flatten()]  # every cell's count is written in it
    assert [t.get_text() for t in ax_cm.get_xticklabels()] == exp["class_names"]
    assert [t.get_text() for t in ax_cm.get_yticklabels()] == exp["class_names"]
    assert (ax_cm.get_xlabel(), ax_cm.get_ylabel()) == ("predicted", "true")
    assert f"accuracy {exp['test_acc']:.1%}" in ax_cm.get_title()
    assert wrong_panel.get_suptitle().startswith("most confidently wrong test images")
    names = exp["class_names"]
    # One tile per wrong image, most confident first, each captioned (predicted / true on two lines).
    assert len(tiles) == len(captions) == len(exp["wrong"])
    texts = [text.get_text().replace("\n", " ") for text in captions]
    assert texts == [f"{names[p]} / {names[t]} ({c:.0%})" for c, _, p, t in exp["wrong"]]
    for tile, (_, image, _, _) in zip(tiles, exp["wrong"], strict=True):
        assert tile.get_array().shape[:2] == image.shape[-2:]  # the image itself, not a resized copy


@pytest.mark.claim("report-in-loggers")
def test_report_same_image_in_tensorboard_and_wandb(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    drawn = np.asarray(Image.open(run_dir / "report.png").convert("RGB"))
    events = EventAccumulator(str(run_dir), size_guidance={"images": 0}).Reload().Images("report")
    # Once: after the test that follows fit, not also at fit's end (the same picture without the test panels).
    assert len(events) == 1
    last_tb = np.asarray(Image.open(io.BytesIO(events[-1].encoded_image_string)).convert("RGB"))
    assert np.array_equal(last_tb, drawn)
    from project.loggers import wandb_run_id  # the id W&B's own folder under the run dir records

    run_id = wandb_run_id(run_dir)
    media = glob.glob(str(run_dir / f"wandb/offline-run-*-{run_id}/files/media/images/report_*.png"))
    assert len(media) == 1  # W&B names each image report_<its step>_<hash>.png
    last_wandb = max(media, key=lambda p: int(Path(p).name.split("_")[1]))
    assert np.array_equal(np.asarray(Image.open(last_wandb).convert("RGB")), drawn)


@pytest.mark.claim("run-report")
def test_report_is_drawn_in_the_default_style_whatever_the_process_set():
    """A style set earlier in the process (Optuna's matplotlib plots, which the sweep report draws, call
    plt.style.use("ggplot")) changes no pixel: a run in that process drew another picture of the same data."""
    import matplotlib
    import matplotlib.pyplot as plt

    epochs = {0: {"train/loss": 2.0, "val/loss": 1.9, "train/acc": 0.3, "val/acc": 0.4}}
    args = (epochs, [[0.1]], torch.eye(3, dtype=torch.long), [(0.9, torch.rand(1, 8, 8), 1, 2)], None, 40)
    default = render(*args)
    with matplotlib.rc_context():  # the style stays this test's
        plt.style.use("ggplot")
        assert np.array_equal(render(*args), default)


def test_report_works_without_test_results():
    epochs = {0: {"train/loss": 2.0, "val/loss": 1.9}, 1: {"train/loss": 1.5}}
    image = render(epochs, [[0.1], [0.2]], None, [], None, 50)
    assert image.shape == (500, 750, 3)  # 15 x 10 inches at dpi 50
    fig = report_figure(epochs, [[0.1], [0.2]], None, [], None, 50)
    ax_loss, ax_acc, ax_lr = fig.subfigs[0].axes
    lines = {line.get_label(): list(line.get_xdata()) for line in ax_loss.lines}
    assert lines == {"train": [0, 1], "val": [0]}
    assert _texts(ax_acc) == ["nothing logged"]
    assert [list(line.get_ydata()) for line in ax_lr.lines] == [[0.1, 0.2]]
    assert [line.get_label() for line in ax_lr.lines] == [
        "pg1"
    ]  # an unnamed group: LearningRateMonitor's name
    ax_cm, wrong_panel, tiles, captions = _panels(fig)
    assert _texts(ax_cm) == ["confusion matrix: after test"] and not ax_cm.images
    assert wrong_panel.get_suptitle() == "no wrong test images" and not tiles and not captions


def test_report_history_survives_checkpoint_restore():
    from project.callbacks.report import RunReport

    resumed = RunReport()  # a resumed fit: the checkpoint holds epochs 0-1, this process adds epoch 2
    checkpoint = RunReport()
    checkpoint.epochs, checkpoint.lrs = {0: {"val/acc": 0.1}, 1: {"val/acc": 0.2}}, {0: [1e-3], 5: [2e-3]}
    resumed.load_state_dict(checkpoint.state_dict())
    resumed.epochs[2], resumed.lrs[10] = {"val/acc": 0.3}, [1e-4]
    state = resumed.state_dict()
    assert sorted(state["epochs"]) == [0, 1, 2] and state["lr_steps"].tolist() == [0, 5, 10]
    assert state["lr_values"].tolist() == [[1e-3], [2e-3], [1e-4]]
    # Through a checkpoint's own state (a resumed run of a resumed run), and with a group added mid-run.
    again = RunReport()
    again.load_state_dict(state)
    again.lrs[11] = [1e-5, 1e-6]
    assert again.lrs == {0: [1e-3], 5: [2e-3], 10: [1e-4], 11: [1e-5, 1e-6]}
    packed = again.state_dict()
    assert packed["lr_values"].shape == (4, 2)
    fresh = RunReport()
    fresh.load_state_dict(packed)
    assert fresh.lrs == {0: [1e-3], 5: [2e-3], 10: [1e-4], 11: [1e-5, 1e-6]}
    # The test after fit restores the best (earlier) checkpoint: the epochs seen in this process stay.
    checkpoint.epochs, checkpoint.lrs = {0: {"val/acc": 0.1}}, {0: [1e-3]}
    resumed.load_state_dict(checkpoint.state_dict())
    assert resumed.state_dict()["epochs"][2] == {"val/acc": 0.3}
    # Group names: this process's when it recorded some, else the checkpoint's.
    assert resumed.state_dict()["lr_names"] == []
    resumed.load_state_dict({"lr_names": ["decay", "no_decay"]})
    assert resumed.state_dict()["lr_names"] == ["decay", "no_decay"]
    resumed.lr_names = ["head"]
    assert resumed.state_dict()["lr_names"] == ["head"]


def test_report_lr_lines_named_and_equal_groups_shared():
    # Fine-tuning's four groups: the backbone's two at one rate, the head's two at another.
    names = ["backbone", "backbone_no_decay", "head", "head_no_decay"]
    lrs = [[1e-4 * s, 1e-4 * s, 1e-3 * s, 1e-3 * s] for s in range(5)]
    fig = report_figure({}, lrs, None, [], None, 50, names)
    ax_lr = fig.subfigs[0].axes[2]
    _assert_lr_lines(ax_lr, lrs, names)
    assert [line.get_label() for line in ax_lr.lines] == [
        "backbone, backbone_no_decay",
        "head, head_no_decay",
    ]
    assert [t.get_text() for t in ax_lr.get_legend().get_texts()] == [
        line.get_label() for line in ax_lr.lines
    ]
    lrs[2][1] = 0.5  # one step differs: two lines, not one hiding the other
    fig = report_figure({}, lrs, None, [], None, 50, names)
    _assert_lr_lines(fig.subfigs[0].axes[2], lrs, names)
    assert len(fig.subfigs[0].axes[2].lines) == 3


# CIFAR-100's longest class names are 13 characters ("aquarium_fish"); these are 13-15.
LONG_NAMES = [f"{'aquarium_fish' if i % 2 else 'sweet_pepper'}_{i}" for i in range(100)]


@pytest.mark.claim("report-captions-clear")
@pytest.mark.parametrize("num_classes", [2, 10, 100])
def test_report_captions_clear_of_images(num_classes):
    """No caption of a wrong image overlaps any image (tile or confusion matrix) nor another caption, for 2, 10 and
    100 classes, each with grey 8x8 and RGB 224x224 inputs; each caption is right above its own image; small images
    are drawn as large as large ones."""
    gen = torch.Generator().manual_seed(num_classes)
    names = LONG_NAMES[:num_classes] if num_classes > 10 else [str(i) for i in range(num_classes)]
    confusion = torch.randint(0, 30, (num_classes, num_classes), generator=gen)
    sides = {}
    # Grey 8x8 and RGB 224x224: the captions depend on the class names only, and each render is slow (matplotlib).
    for channels, size in ((1, 8), (3, 224)):
        wrong = [
            (
                0.99 - k / 100,
                torch.rand(channels, size, size, generator=gen),
                (k + 1) % num_classes,
                k % num_classes,
            )
            for k in range(16)  # RunReport's default num_wrong
        ]
        fig = report_figure({}, [[1e-3]], confusion, wrong, names, 80)  # RunReport's default dpi
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        ax_cm, _, tiles, texts = _panels(fig)
        assert len(tiles) == len(texts) == 16
        images = [tile.get_window_extent(renderer) for tile in tiles] + [ax_cm.get_window_extent(renderer)]
        captions = [text.get_window_extent(renderer) for text in texts]
        for k, box in enumerate(captions):
            hits = [i for i, image in enumerate(images) if box.overlaps(image)]
            assert not hits, (
                f"caption {k} {texts[k].get_text()!r} overlaps images {hits} ({channels}x{size}px)"
            )
            others = [i for i, other in enumerate(captions) if i != k and box.overlaps(other)]
            assert not others, f"caption {k} overlaps captions {others} ({channels}x{size}px)"
            own = images[k]  # the caption's own image: right below it, centred under it
            assert own.ymax < box.ymin < own.ymax + own.height / 2, (k, box, own)
            assert abs((box.xmin + box.xmax) / 2 - (own.xmin + own.xmax) / 2) < 1, (k, box, own)
        sides[(channels, size)] = round(images[0].width, 3)
    # The tiles' size depends on the panel and the captions only, not on the image size or colour.
    assert len(set(sides.values())) == 1, sides

"""RunReport: `<run dir>/report.png` after test (or after fit when no test follows), also logged as an image to the
active loggers.

Panels: train/val loss and accuracy per epoch, the learning rate of every parameter group per step (labelled with
the groups' `name`, as LearningRateMonitor tags them; groups whose rates are equal at every step share one line),
the test confusion matrix with class names, and the most confidently wrong test images (when the test inputs are
image batches (B, C, H, W); for other data, such as a DatasetDataModule's sequences, that panel says it is not
drawn and the rest stays). matplotlib is imported
here only, when a report is drawn, so that runs without this callback never pay for it.

The confusion matrix is torchmetrics' own `MulticlassConfusionMatrix.plot(ax=..., labels=...)`. Up to 15 classes
every cell's count is written in it; above 30 classes the class names are left off the axes (100 names on a
5-inch axis overlap into an unreadable band) and every 10th class index is marked instead.
"""

from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from torchmetrics.classification import MulticlassConfusionMatrix

from project.atomic import atomic_write
from project.callbacks.run_checkpoint import stage_metrics

CURVES = ("train/loss", "val/loss", "train/acc", "val/acc")


class RunReport(Callback):
    """Draws the run report.

    Args:
        filename: file name inside the run directory.
        num_wrong: how many confidently wrong test images to show (in the grid that draws them largest).
        dpi: resolution; the figure is 15 x 10 inches.
    """

    def __init__(self, filename: str = "report.png", num_wrong: int = 16, dpi: int = 80) -> None:
        self.filename, self.num_wrong, self.dpi = filename, num_wrong, dpi
        # Set by the CLI when `trainer.test` runs right after this fit (`--test_after_fit`, the default): the
        # report is then drawn once, after the test, and not also at the fit's end (drawing it is a visible part
        # of a short fit's time, inside trainer.fit: 0.6 s of the default run's). An interrupted fit,
        # which is not tested, still draws it at the fit's end.
        self.test_follows_fit = False
        self.epochs: dict[int, dict[str, float]] = {}  # epoch -> {"train/loss": ..., ...}
        self.lrs: dict[int, list[float]] = {}  # global step -> the lr of each parameter group
        self.lr_names: list[str] = []  # each parameter group's `name` (LearningRateMonitor's tag suffix)
        self._restored: dict = {
            "epochs": {},
            "lrs": {},
            "lr_names": [],
        }  # from a checkpoint: the run before it
        self._reset_test()

    # -- collecting ----------------------------------------------------------------------------------------
    def _record(self, trainer: "L.Trainer", epoch: int, stage: str) -> None:
        logged = stage_metrics(trainer.callback_metrics, stage)  # val/loss, also as logged val_loss
        for key in CURVES:
            if key in logged:
                self.epochs.setdefault(epoch, {})[key] = logged[key]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if trainer.optimizers:  # plain floats from the optimizer: no device sync
            groups = trainer.optimizers[0].param_groups
            self.lrs[trainer.global_step] = [g["lr"] for g in groups]
            if len(self.lr_names) != len(groups):
                self.lr_names = group_names(groups)

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:  # runs after the module logged val/* for this epoch
            self._record(trainer, trainer.current_epoch, "val")

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        # Callbacks' on_train_epoch_end runs before the module logs train/*, so read them one hook later.
        if trainer.current_epoch > 0:
            self._record(trainer, trainer.current_epoch - 1, "train")

    def on_fit_end(self, trainer, pl_module) -> None:
        self._record(trainer, trainer.current_epoch - 1, "train")
        if not (self.test_follows_fit and not trainer.interrupted):
            self._draw(trainer)

    def _reset_test(self) -> None:
        self.confusion: MulticlassConfusionMatrix | None = None
        self.matrix: Tensor | None = None  # the computed (num_classes, num_classes) test confusion matrix
        self.wrong: list[tuple[float, Tensor, int, int]] = []  # (confidence, image, predicted, true)
        self.images = True  # the test inputs are image batches (B, C, H, W): the wrong ones can be drawn

    def on_test_start(self, trainer, pl_module) -> None:
        self._reset_test()
        if not is_classifier(pl_module):
            return  # not a classifier (configs/autoencoder.yaml): the curves and learning rates only
        # On the module's device: under DDP, compute() then gathers every rank's share of the test set.
        self.confusion = MulticlassConfusionMatrix(num_classes=pl_module.num_classes).to(pl_module.device)

    def on_test_batch_end(
        self, trainer, pl_module, outputs, batch, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self.confusion is None:
            return
        x, y = batch
        if not (isinstance(outputs, Tensor) and outputs.shape == (len(y), pl_module.num_classes)):
            with torch.no_grad():  # test_step returned no logits: compute them
                outputs = pl_module(x)
        conf, pred = outputs.detach().float().softmax(dim=-1).max(dim=-1)
        self.confusion.update(pred, y)
        self.images = self.images and isinstance(x, Tensor) and x.ndim == 4
        if not self.images:  # sequences, several inputs, ...: the confusion matrix only
            return
        conf, pred, y = conf.cpu(), pred.cpu(), y.cpu()  # the wrong examples kept here are this rank's only
        for i in torch.nonzero(pred != y).flatten().tolist():
            self.wrong.append((float(conf[i]), x[i].detach().float().cpu(), int(pred[i]), int(y[i])))
        self.wrong = sorted(self.wrong, key=lambda w: -w[0])[: self.num_wrong]

    def on_test_end(self, trainer, pl_module) -> None:
        # compute() is collective under DDP (it gathers every rank's counts): every rank calls it, also one whose
        # shard of the test set was empty, or the others would wait for it until the collective timeout. In one
        # process a matrix that was never fed means no test batch ran: nothing to draw.
        if self.confusion is not None and (self.confusion.update_called or trainer.world_size > 1):
            self.matrix = self.confusion.compute().cpu()
        self._draw(trainer)

    # Saved in checkpoints, so that a resumed fit, or `python -m project test` alone, still draws the curves.
    def state_dict(self) -> dict:
        history = self.history()
        return {"epochs": history["epochs"], **pack_lrs(history["lrs"]), "lr_names": history["lr_names"]}

    def load_state_dict(self, state: dict) -> None:
        # Kept apart: restoring the best checkpoint for the test after fit must not drop the later epochs.
        self._restored = {
            "epochs": dict(state.get("epochs", {})),
            "lrs": unpack_lrs(state),
            "lr_names": list(state.get("lr_names", [])),
        }

    def history(self) -> dict:
        """Everything recorded: {"epochs": {epoch: {key: value}}, "lrs": {step: [lr per group]}, "lr_names": [...]}.
        What this process saw wins over the restored part."""
        return {
            "epochs": {**self._restored["epochs"], **self.epochs},
            "lrs": {**self._restored["lrs"], **self.lrs},
            "lr_names": self.lr_names or self._restored["lr_names"],
        }

    # -- drawing -------------------------------------------------------------------------------------------
    def _draw(self, trainer: "L.Trainer") -> None:
        if not trainer.is_global_zero or getattr(trainer, "fast_dev_run", False):
            return
        run_dir = Path(trainer.default_root_dir)
        history = self.history()
        lrs = [history["lrs"][step] for step in sorted(history["lrs"])]
        names = getattr(trainer.datamodule, "class_names", None)
        wrong = self.wrong if self.images else None
        classifier = is_classifier(trainer.lightning_module)
        image = render(
            history["epochs"], lrs, self.matrix, wrong, names, self.dpi, history["lr_names"], classifier
        )
        run_dir.mkdir(parents=True, exist_ok=True)
        from PIL import Image

        with atomic_write(run_dir / self.filename, "wb") as f:
            Image.fromarray(image).save(f, format="PNG")
        for logger in trainer.loggers:
            _log_image(logger, image, trainer.global_step)


def is_classifier(module) -> bool:
    """A module with an int `num_classes` (ClassificationModule and its subclasses): the confusion matrix and wrong
    images apply; another task (configs/autoencoder.yaml) gets the curves only."""
    return isinstance(getattr(module, "num_classes", None), int)


def pack_lrs(lrs: dict[int, list[float]]) -> dict[str, Tensor]:
    """The per-step learning rates as two tensors for a checkpoint: `lr_steps` (N,) and `lr_values` (N, groups).

    As a {step: [lr, ...]} mapping every step is a few pickled objects, each a Python call in torch.save: 300 steps
    made 800 of the 3,500 objects of the default run's last.ckpt, and a 500k-step run would pickle ~1.5M at every
    save. Two tensors are two records whatever the length. A step with fewer groups (a group added mid-run) is
    padded with NaN, which unpack_lrs drops.
    """
    steps = sorted(lrs)
    rows = [lrs[s] for s in steps]
    width = max(map(len, rows), default=0)
    if any(len(row) != width for row in rows):
        rows = [[*row, *[float("nan")] * (width - len(row))] for row in rows]
    values = torch.tensor(rows, dtype=torch.float64).reshape(len(steps), width)  # one call: C speed
    return {"lr_steps": torch.tensor(steps, dtype=torch.int64), "lr_values": values}


def unpack_lrs(state: dict) -> dict[int, list[float]]:
    """pack_lrs' inverse; also reads the {step: [lr, ...]} mapping that checkpoints before it stored as `lrs`."""
    if "lr_steps" not in state:
        return dict(state.get("lrs", {}))
    steps, values = state["lr_steps"].tolist(), state["lr_values"]
    rows = values.tolist()
    if values.isnan().any():
        rows = [[v for v in row if v == v] for row in rows]  # NaN != NaN: the padding
    return dict(zip(steps, rows, strict=True))


def _log_image(logger, image, step: int) -> None:
    from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger

    if isinstance(logger, TensorBoardLogger):
        logger.experiment.add_image("report", image, step, dataformats="HWC")
    elif isinstance(logger, WandbLogger):
        logger.log_image("report", [image], step=step)


def group_names(param_groups: list[dict]) -> list[str]:
    """Each group's `name`, else `pg<i>` (1-based), as LearningRateMonitor names its tags `lr-<Optimizer>/<name>`."""
    return [str(g.get("name") or f"pg{i + 1}") for i, g in enumerate(param_groups)]


def render(epochs, lrs, confusion, wrong, class_names, dpi: int, lr_names=None, classifier: bool = True):
    """The report as an (H, W, 3) uint8 array; confusion is a (num_classes, num_classes) tensor or None; wrong is
    None when the test inputs were not images (the panel says so). Not a classifier: the curves only."""
    import numpy as np

    fig = report_figure(epochs, lrs, confusion, wrong, class_names, dpi, lr_names, classifier)
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()


def report_figure(
    epochs, lrs, confusion, wrong, class_names, dpi: int, lr_names=None, classifier: bool = True
):
    """The report's matplotlib Figure (what `render` rasterises): its axes hold the data drawn.

    Layout: `fig.subfigs[0]` holds the loss, accuracy and learning-rate axes; `fig.subfigs[1].subfigs[0]` the
    confusion matrix, `fig.subfigs[1].subfigs[1]` one axes per wrong image, captioned by its title. Not a
    classifier: the figure holds the three axes of the top row only.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 10 if classifier else 5), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subfigures(2, 1) if classifier else (fig, None)
    ax_loss, ax_acc, ax_lr = top.subplots(1, 3)
    xs = sorted(epochs)
    for ax, metric in ((ax_loss, "loss"), (ax_acc, "acc")):
        for split in ("train", "val"):
            pts = [(e, epochs[e][f"{split}/{metric}"]) for e in xs if f"{split}/{metric}" in epochs[e]]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=split)
        ax.set(title=f"{metric} per epoch", xlabel="epoch")
        if ax.lines:
            ax.legend()
        else:
            said = "no epochs logged" if classifier or metric == "loss" else "not a classifier: no accuracy"
            ax.text(0.5, 0.5, said, ha="center", transform=ax.transAxes)
    _lr_lines(ax_lr, lrs, lr_names)
    if bottom is None:
        return fig
    left, right = bottom.subfigures(1, 2)
    _confusion(left.subplots(), confusion, class_names)
    _wrong_grid(right, wrong, class_names)
    return fig


def _lr_lines(ax, lrs, lr_names) -> None:
    """One line per distinct series; groups with the same rate at every step share it, labelled with all names."""
    if lrs:
        series = list(zip(*lrs, strict=True))
        names = (
            list(lr_names)
            if lr_names and len(lr_names) == len(series)
            else [f"pg{g + 1}" for g in range(len(series))]
        )
        lines: dict[tuple, list[str]] = {}  # identical series -> the names that share it (insertion order)
        for name, values in zip(names, series, strict=True):
            lines.setdefault(tuple(values), []).append(name)
        for values, shared in lines.items():
            ax.plot(values, label=", ".join(shared))
        ax.legend(fontsize="small")
    ax.set(title="learning rate per step", xlabel="step")


def _confusion(ax, confusion, class_names) -> None:
    import numpy as np

    if confusion is None:
        ax.set_axis_off()
        ax.text(0.5, 0.5, "confusion matrix: after test", ha="center")
        return
    n = confusion.shape[0]
    names = list(class_names) if class_names and len(class_names) == n else [str(i) for i in range(n)]
    MulticlassConfusionMatrix(num_classes=n).plot(
        val=confusion, ax=ax, labels=names, add_text=n <= 15, cmap="Blues"
    )
    if n > 30:  # names would overlap: every 10th class index instead
        ticks = list(range(0, n, 10))
        ax.set_xticks(ticks, [str(i) for i in ticks], rotation=0)
        ax.set_yticks(ticks, [str(i) for i in ticks], rotation=0)
    ax.tick_params(labelsize="small")
    ax.tick_params(axis="y", labelrotation=0)  # torchmetrics tilts them 25 degrees
    for text in ax.texts:
        text.set_fontsize("x-small")
    cm = confusion.numpy()
    ax.set_title(f"test confusion matrix (accuracy {np.trace(cm) / max(1, cm.sum()):.1%})", fontsize="large")
    ax.set_xlabel("predicted" if n <= 30 else "predicted (class index)", fontsize="medium")
    ax.set_ylabel("true" if n <= 30 else "true (class index)", fontsize="medium")


# Caption font size (points) of the wrong images; the panel they share (inches: half the figure's width, about
# half its height less the panel title); the height kept for a caption of two lines (inches).
CAPTION_PT, PANEL_IN, PANEL_HEIGHT_IN, CAPTION_IN = 8.0, 7.5, 4.6, 0.3


def grid_shape(count: int) -> tuple[int, int]:
    """(rows, columns) for `count` images that makes each image largest in the panel: 16 images go in 3 x 6."""

    def side(columns: int) -> float:
        rows = -(-count // columns)
        return min(PANEL_IN / columns, PANEL_HEIGHT_IN / rows - CAPTION_IN)

    columns = max(range(1, count + 1), key=side)  # max() keeps the first best: the fewest columns
    return -(-count // columns), columns


def caption(pred: str, true: str, conf: float, columns: int) -> str:
    """`pred / true (confidence)`, wrapped to the width of one tile's column (so no caption runs into the next)."""
    import textwrap

    chars = max(8, int(PANEL_IN * 72 / columns / (0.7 * CAPTION_PT)))  # <= 0.7 em per character (DejaVu Sans)
    return textwrap.fill(f"{pred} / {true} ({conf:.0%})", chars, break_long_words=True)


def _wrong_grid(subfig, wrong, class_names) -> None:
    """One axes per image, its caption the axes' title: constrained layout then keeps every caption clear of
    every image, whatever the image size, the number of images or the length of the class names, and the
    images fill the panel (an 8x8 image is drawn as large as a 224x224 one)."""
    if wrong is None:
        subfig.suptitle("wrong test examples: not drawn (the inputs are not images)")
        return
    subfig.suptitle(
        "most confidently wrong test images: predicted / true (confidence)"
        if wrong
        else "no wrong test images"
    )
    if not wrong:
        return
    rows, columns = grid_shape(len(wrong))
    axes = subfig.subplots(rows, columns, squeeze=False).flatten()
    name = (lambda i: class_names[i]) if class_names else str
    for ax, (conf, img, pred, true) in zip(axes, wrong, strict=False):
        img = (img - img.min()) / (img.max() - img.min()).clamp_min(1e-8)  # (C, H, W) to [0, 1] for display
        if img.shape[0] == 1:
            ax.imshow(img[0].numpy(), cmap="gray", vmin=0, vmax=1, interpolation="nearest")
        else:
            ax.imshow(img[:3].permute(1, 2, 0).numpy(), interpolation="nearest")
        ax.set_title(
            caption(name(pred), name(true), conf, columns), fontsize=CAPTION_PT, y=1, pad=2, va="bottom"
        )
        ax.set_axis_off()
    for ax in axes[len(wrong) :]:
        ax.remove()

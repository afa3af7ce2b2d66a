"""RunReport: `<run dir>/report.png` (docs/recipes.md "Run report") after test, or after fit when no test follows,
also logged as an image. A module without an int `num_classes` gets the curves only."""

import math
from pathlib import Path

import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger
from matplotlib import style
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from torch import Tensor
from torchmetrics.classification import MulticlassConfusionMatrix

from project.atomic import atomic_write
from project.callbacks.run_checkpoint import stage_metrics


class RunReport(Callback):
    """Args: filename (in the run directory), num_wrong (test images shown), dpi (of a 15 x 10 inch figure)."""

    def __init__(self, filename: str = "report.png", num_wrong: int = 16, dpi: int = 80) -> None:
        self.filename, self.num_wrong, self.dpi = filename, num_wrong, dpi
        self.test_follows_fit = False  # set by the CLI: drawn once, after that test
        self.epochs: dict[int, dict[str, float]] = {}  # epoch -> {"train/loss": ..., ...}
        self.lrs: dict[int, list[float]] = {}  # global step -> the lr of each parameter group
        self.lr_names: list[str] = []  # each group's `name`, else pg<i> (LearningRateMonitor's tag suffix)
        self.on_test_start(None, None)  # no test yet

    def _record(self, trainer, epoch: int, stage: str) -> None:
        logged = stage_metrics(trainer.callback_metrics, stage)  # val/loss, also when logged as val_loss
        if curves := {k: v for k, v in logged.items() if k.endswith(("/loss", "/acc"))}:
            self.epochs.setdefault(epoch, {}).update(curves)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if not trainer.optimizers:
            return
        groups = trainer.optimizers[0].param_groups
        self.lrs[trainer.global_step] = [g["lr"] for g in groups]  # plain floats: no device sync
        if len(self.lr_names) != len(groups):
            self.lr_names = [str(g.get("name") or f"pg{i + 1}") for i, g in enumerate(groups)]

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self._record(trainer, trainer.current_epoch, "val")

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.current_epoch > 0:  # the module logs train/* after the callbacks' on_train_epoch_end
            self._record(trainer, trainer.current_epoch - 1, "train")

    def on_fit_end(self, trainer, pl_module) -> None:
        self._record(trainer, trainer.current_epoch - 1, "train")
        if not (self.test_follows_fit and not trainer.interrupted):
            self._draw(trainer)

    def on_test_start(self, trainer, pl_module) -> None:
        self.matrix: Tensor | None = None  # the (num_classes, num_classes) test confusion matrix
        self.wrong: list[tuple[float, Tensor, int, int]] = []  # (confidence, image, predicted, true)
        self.images = True  # the test inputs are image batches: the wrong ones can be drawn
        # On the module's device: under DDP, compute() gathers every rank's counts.
        classes = pl_module.num_classes if is_classifier(pl_module) else None
        self.confusion = MulticlassConfusionMatrix(classes).to(pl_module.device) if classes else None

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int, *rest) -> None:
        if self.confusion is None:
            return
        x, y = batch
        if not (isinstance(outputs, Tensor) and outputs.shape == (len(y), pl_module.num_classes)):
            with torch.no_grad():  # test_step returned no logits
                outputs = pl_module(x)
        conf, pred = outputs.detach().float().softmax(dim=-1).max(dim=-1)
        self.confusion.update(pred, y)
        self.images = self.images and isinstance(x, Tensor) and x.ndim == 4
        if self.images:  # this rank's wrong images only
            conf, pred, y = conf.cpu(), pred.cpu(), y.cpu()
            for i in torch.nonzero(pred != y).flatten().tolist():
                self.wrong.append((float(conf[i]), x[i].detach().float().cpu(), int(pred[i]), int(y[i])))
            self.wrong = sorted(self.wrong, key=lambda w: -w[0])[: self.num_wrong]

    def on_test_end(self, trainer, pl_module) -> None:
        # compute() is collective under DDP: every rank calls it, also one with an empty test shard.
        if self.confusion is not None and (self.confusion.update_called or trainer.world_size > 1):
            self.matrix = self.confusion.compute().cpu()
        self._draw(trainer)

    def state_dict(self) -> dict:
        # A resumed fit, or `python -m project test` alone, draws the whole run. The rates as two tensors (NaN where
        # a group was added mid-run): a dict would pickle a few objects per step at every save.
        width = max(map(len, self.lrs.values()), default=0)
        rows = [row + [math.nan] * (width - len(row)) for _, row in sorted(self.lrs.items())]
        values = torch.tensor(rows, dtype=torch.float64).reshape(len(rows), width)
        lr_steps = torch.tensor(sorted(self.lrs), dtype=torch.int64)
        return {"epochs": self.epochs, "lr_steps": lr_steps, "lr_values": values, "lr_names": self.lr_names}

    def load_state_dict(self, state: dict) -> None:
        # What this process recorded wins: restoring the best checkpoint for the test after fit keeps later epochs.
        if "lr_steps" in state:
            rows = [[v for v in row if v == v] for row in state["lr_values"].tolist()]  # drop the NaN padding
            self.lrs = {**dict(zip(state["lr_steps"].tolist(), rows, strict=True)), **self.lrs}
        self.epochs = {**state.get("epochs", {}), **self.epochs}
        self.lr_names = self.lr_names or list(state.get("lr_names", []))

    def _draw(self, trainer) -> None:
        if not trainer.is_global_zero or trainer.fast_dev_run:
            return
        from PIL import Image

        lrs = [rates for _, rates in sorted(self.lrs.items())]
        names = getattr(trainer.datamodule, "class_names", None)
        wrong, classifier = self.wrong if self.images else None, is_classifier(trainer.lightning_module)
        image = render(self.epochs, lrs, self.matrix, wrong, names, self.dpi, self.lr_names, classifier)
        Path(trainer.default_root_dir).mkdir(parents=True, exist_ok=True)
        with atomic_write(Path(trainer.default_root_dir) / self.filename, "wb") as f:
            Image.fromarray(image).save(f, format="PNG")
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_image("report", image, trainer.global_step, dataformats="HWC")
            elif isinstance(logger, WandbLogger):
                logger.log_image("report", [image], step=trainer.global_step)


def is_classifier(module) -> bool:
    """A module with an int `num_classes`: the confusion matrix and wrong images apply."""
    return isinstance(getattr(module, "num_classes", None), int)


def render(epochs, lrs, confusion, wrong, class_names, dpi: int, lr_names=None, classifier: bool = True):
    """The report as an (H, W, 3) uint8 array, in matplotlib's default style (Optuna's plots set ggplot)."""
    with style.context("default"):
        fig = report_figure(epochs, lrs, confusion, wrong, class_names, dpi, lr_names, classifier)
        fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()


def report_figure(epochs, lrs, confusion, wrong, class_names, dpi: int, lr_names=None, classifier=True):
    """`fig.subfigs[0]`: loss, accuracy and lr axes; `fig.subfigs[1].subfigs`: confusion matrix axes and one
    axes of the wrong images (AxesImages) under their captions (texts). Not a classifier: the top row only."""
    fig = FigureCanvasAgg(Figure(figsize=(15, 10 if classifier else 5), dpi=dpi, layout="none")).figure
    top, bottom = fig.subfigures(2, 1) if classifier else (fig, None)
    ax_loss, ax_acc, ax_lr = top.subplots(1, 3, gridspec_kw=dict(left=0.05, right=0.98, top=0.92))
    for ax, metric in ((ax_loss, "loss"), (ax_acc, "acc")):
        for split in ("train", "val"):
            key = f"{split}/{metric}"
            if points := [(e, epochs[e][key]) for e in sorted(epochs) if key in epochs[e]]:
                ax.plot(*zip(*points, strict=True), marker="o", label=split)
        ax.set_title(f"{metric} per epoch", y=1)  # a fixed y: not moved clear of tick labels at each draw
        ax.set_xlabel("epoch")
        ax.locator_params(axis="x", integer=True)
        if ax.lines:
            ax.legend()
        else:
            ax.text(0.5, 0.5, "nothing logged", ha="center", transform=ax.transAxes)
    if lrs:  # one line per distinct series, labelled with the names of the groups that share it
        series = list(zip(*lrs, strict=True))
        names = lr_names if lr_names and len(lr_names) == len(series) else None
        names = names or [f"pg{g + 1}" for g in range(len(series))]
        lines: dict[tuple, list[str]] = {}
        for name, values in zip(names, series, strict=True):
            lines.setdefault(tuple(values), []).append(name)
        for values, shared in lines.items():
            ax_lr.plot(values, label=", ".join(shared))
        ax_lr.legend(fontsize="small")
    ax_lr.set_title("learning rate per step", y=1)
    ax_lr.set_xlabel("step")
    if bottom is not None:
        left, right = bottom.subfigures(1, 2)
        _confusion(left.add_axes((0, 0, 1, 1)), confusion, class_names)
        _wrong_grid(right, wrong, class_names)
    return fig


def _confusion(ax, confusion, class_names) -> None:
    if confusion is None:
        ax.set_axis_off()
        ax.text(0.5, 0.5, "confusion matrix: after test", ha="center")
        return
    n = confusion.shape[0]
    ticks = range(0, n, 10 if (many := n > 30) else 1)  # 100 names on 5 inches overlap: class indices instead
    names = class_names if class_names and len(class_names) == n and not many else [str(i) for i in ticks]
    ax.imshow(counts := confusion.numpy(), cmap="Blues")
    ax.set_xticks(ticks, names, rotation=0 if many else 45, fontsize="small")
    ax.set_yticks(ticks, names, fontsize="small")
    ax.set_title(f"test confusion matrix (accuracy {counts.trace() / max(1, counts.sum()):.1%})", y=1)
    ax.set(xlabel="predicted" + " (class index)" * many, ylabel="true" + " (class index)" * many)
    # Cheaper than a layout engine: shrink the axes by what its labels and title take beyond it (pixels).
    pad, box, tight = ax.figure.dpi / 8, ax.figure.bbox, ax.get_tightbbox()
    low, high = ax.bbox.p0 - tight.p0 + pad, box.size - (tight.p1 - ax.bbox.p1) - pad
    ax.set_position((*low / box.size, *(high - low) / box.size))
    for (i, j), count in np.ndenumerate(counts if n <= 15 else []):  # white on the darker half of the colours
        ax.text(j, i, count, ha="center", va="center", size="x-small", c="kw"[int(2 * count > counts.max())])


def _wrong_grid(subfig, wrong, class_names) -> None:
    """One axes (an axes each costs more than the drawing): equal tiles, sized to keep every caption clear."""
    none = "wrong test examples: not drawn (inputs not images)" if wrong is None else "no wrong test images"
    subfig.suptitle("most confidently wrong test images: predicted / true (confidence)" if wrong else none)
    if not wrong:
        return
    (w, h), name = subfig.bbox.size * (1, 0.91), class_names.__getitem__ if class_names else str  # pixels
    ax = subfig.add_axes((0, 0.02, 1, 0.91), xlim=(0, w), ylim=(h, 0), frame_on=False, xticks=(), yticks=())
    texts = [ax.text(0, 0, f"{name(p)} /\n{name(t)} ({c:.0%})", size=8, ha="center") for c, _, p, t in wrong]
    columns, pad = math.ceil(math.sqrt(len(wrong))), subfig.dpi / 36  # pad: 2 points around each caption
    dx, dy = w / columns, h / math.ceil(len(wrong) / columns)  # a cell: the caption, the tile at its bottom
    scale = min(1, 0.9 * dx / max(t.get_window_extent().width for t in texts))  # never wider than a column
    for text in texts:  # measured again below: text extents do not scale linearly with the size
        text.set_fontsize(8 * scale)
    side = min(0.9 * dx, dy - max(t.get_window_extent().height for t in texts) - 2 * pad)
    for k, (text, (_, im, _, _)) in enumerate(zip(texts, wrong, strict=True)):
        x, y = (k % columns + 0.5) * dx - side / 2, (k // columns + 1) * dy - pad - side
        im = ((im - im.min()) / (im.max() - im.min()).clamp_min(1e-8))[:3].movedim(0, -1).squeeze(-1).numpy()
        ax.imshow(im, cmap="gray", interpolation="nearest", extent=(x, x + side, y + side, y))
        text.set(position=(x + side / 2, y - pad), va="bottom")

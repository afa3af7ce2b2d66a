"""RunReport: `<run dir>/report.png` after fit and after test, also logged as an image to the active loggers.

Panels: train/val loss and accuracy per epoch, the learning rate of every parameter group per step, the test
confusion matrix with class names, and the most confidently wrong test images. matplotlib is imported here
only, when a report is drawn, so that runs without this callback never pay for it.
"""

from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from torchmetrics.classification import MulticlassConfusionMatrix

CURVES = ("train/loss", "val/loss", "train/acc", "val/acc")


class RunReport(Callback):
    """Draws the run report.

    Args:
        filename: file name inside the run directory.
        num_wrong: how many confidently wrong test images to show (a square grid).
        dpi: resolution; the figure is 15 x 10 inches.
    """

    def __init__(self, filename: str = "report.png", num_wrong: int = 16, dpi: int = 80) -> None:
        self.filename, self.num_wrong, self.dpi = filename, num_wrong, dpi
        self.epochs: dict[int, dict[str, float]] = {}  # epoch -> {"train/loss": ..., ...}
        self.lrs: dict[int, list[float]] = {}  # global step -> the lr of each parameter group
        self._restored: dict = {"epochs": {}, "lrs": {}}  # from a checkpoint: the part of the run before it
        self._reset_test()

    # -- collecting ----------------------------------------------------------------------------------------
    def _record(self, trainer: "L.Trainer", epoch: int, prefix: str) -> None:
        for key in CURVES:
            if key.startswith(prefix) and key in trainer.callback_metrics:
                self.epochs.setdefault(epoch, {})[key] = float(trainer.callback_metrics[key])

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if trainer.optimizers:  # plain floats from the optimizer: no device sync
            self.lrs[trainer.global_step] = [g["lr"] for g in trainer.optimizers[0].param_groups]

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:  # runs after the module logged val/* for this epoch
            self._record(trainer, trainer.current_epoch, "val/")

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        # Callbacks' on_train_epoch_end runs before the module logs train/*, so read them one hook later.
        if trainer.current_epoch > 0:
            self._record(trainer, trainer.current_epoch - 1, "train/")

    def on_fit_end(self, trainer, pl_module) -> None:
        self._record(trainer, trainer.current_epoch - 1, "train/")
        self._draw(trainer)

    def _reset_test(self) -> None:
        self.confusion: MulticlassConfusionMatrix | None = None
        self.matrix: Tensor | None = None  # the computed (num_classes, num_classes) test confusion matrix
        self.wrong: list[tuple[float, Tensor, int, int]] = []  # (confidence, image, predicted, true)

    def on_test_start(self, trainer, pl_module) -> None:
        self._reset_test()
        # On the module's device: under DDP, compute() then gathers every rank's share of the test set.
        self.confusion = MulticlassConfusionMatrix(num_classes=pl_module.num_classes).to(pl_module.device)

    def on_test_batch_end(
        self, trainer, pl_module, outputs, batch, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        x, y = batch
        if not (isinstance(outputs, Tensor) and outputs.shape == (len(y), pl_module.num_classes)):
            with torch.no_grad():  # test_step returned no logits: compute them
                outputs = pl_module(x)
        conf, pred = outputs.detach().float().softmax(dim=-1).max(dim=-1)
        self.confusion.update(pred, y)
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
        return {
            "epochs": {**self._restored["epochs"], **self.epochs},
            "lrs": {**self._restored["lrs"], **self.lrs},
        }

    def load_state_dict(self, state: dict) -> None:
        # Kept apart: restoring the best checkpoint for the test after fit must not drop the later epochs.
        self._restored = {"epochs": dict(state.get("epochs", {})), "lrs": dict(state.get("lrs", {}))}

    # -- drawing -------------------------------------------------------------------------------------------
    def _draw(self, trainer: "L.Trainer") -> None:
        if not trainer.is_global_zero or getattr(trainer, "fast_dev_run", False):
            return
        run_dir = Path(trainer.default_root_dir)
        history = self.state_dict()  # what this process saw wins over the restored part
        lrs = [history["lrs"][step] for step in sorted(history["lrs"])]
        names = getattr(trainer.datamodule, "class_names", None)
        image = render(history["epochs"], lrs, self.matrix, self.wrong, names, self.dpi)
        run_dir.mkdir(parents=True, exist_ok=True)
        from PIL import Image

        Image.fromarray(image).save(run_dir / self.filename)
        for logger in trainer.loggers:
            _log_image(logger, image, trainer.global_step)


def _log_image(logger, image, step: int) -> None:
    from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger

    if isinstance(logger, TensorBoardLogger):
        logger.experiment.add_image("report", image, step, dataformats="HWC")
    elif isinstance(logger, WandbLogger):
        logger.log_image("report", [image], step=step)


def render(epochs, lrs, confusion, wrong, class_names, dpi: int):
    """The report as an (H, W, 3) uint8 array; confusion is a (num_classes, num_classes) tensor or None."""
    import numpy as np

    fig = report_figure(epochs, lrs, confusion, wrong, class_names, dpi)
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()


def report_figure(epochs, lrs, confusion, wrong, class_names, dpi: int):
    """The report's matplotlib Figure (what `render` rasterises): its axes hold the data drawn."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 10), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subfigures(2, 1)
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
            ax.text(0.5, 0.5, "no epochs logged", ha="center", transform=ax.transAxes)
    if lrs:
        for g, series in enumerate(zip(*lrs, strict=True)):
            ax_lr.plot(series, label=f"group {g}")
        ax_lr.legend(fontsize="small")
    ax_lr.set(title="learning rate per step", xlabel="step")

    ax, ax_wrong = bottom.subplots(1, 2)
    if confusion is not None:
        cm = confusion.numpy()
        n = cm.shape[0]
        names = class_names if class_names and len(class_names) == n else [str(i) for i in range(n)]
        ax.imshow(cm, cmap="Blues")
        ticks = range(n) if n <= 30 else []
        ax.set_xticks(list(ticks), [names[i] for i in ticks], rotation=90, fontsize="small")
        ax.set_yticks(list(ticks), [names[i] for i in ticks], fontsize="small")
        if n <= 15:
            for i in range(n):
                for j in range(n):
                    ax.text(
                        j,
                        i,
                        int(cm[i, j]),
                        ha="center",
                        va="center",
                        fontsize="x-small",
                        color="white" if cm[i, j] > cm.max() / 2 else "black",
                    )
        ax.set(
            title=f"test confusion matrix (accuracy {np.trace(cm) / max(1, cm.sum()):.1%})",
            xlabel="predicted",
            ylabel="true",
        )
    else:
        ax.set_axis_off()
        ax.text(0.5, 0.5, "confusion matrix: after test", ha="center")
    _wrong_grid(ax_wrong, wrong, class_names)
    return fig


def _wrong_grid(ax, wrong, class_names) -> None:
    """One mosaic image (one axes, not one per image: drawing stays fast), each tile captioned."""
    from torchvision.utils import make_grid

    ax.set_axis_off()
    ax.set_title(
        "most confidently wrong test images: predicted / true (confidence)"
        if wrong
        else "no wrong test images"
    )
    if not wrong:
        return
    side = max(1, int(len(wrong) ** 0.5 + 0.999))
    tiles = []
    for _, img, _, _ in wrong:
        img = (img - img.min()) / (img.max() - img.min()).clamp_min(1e-8)  # (C, H, W) to [0, 1] for display
        tiles.append(img.expand(3, -1, -1) if img.shape[0] == 1 else img[:3])
    size = max(t.shape[-1] for t in tiles)
    tiles = [torch.nn.functional.interpolate(t[None], size=(size, size), mode="nearest")[0] for t in tiles]
    pad = max(2, size // 3)  # room for the caption above each tile
    grid = make_grid(tiles, nrow=side, padding=pad, pad_value=1.0)  # (3, H, W)
    ax.imshow(grid.permute(1, 2, 0).numpy(), interpolation="nearest")
    name = (lambda i: class_names[i]) if class_names else str
    for k, (conf, _, pred, true) in enumerate(wrong):
        row, col = divmod(k, side)
        ax.text(
            pad + col * (size + pad),
            pad + row * (size + pad) - pad * 0.15,
            f"{name(pred)} / {name(true)} ({conf:.0%})",
            fontsize="small",
            va="bottom",
        )

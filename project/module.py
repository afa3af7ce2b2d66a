"""ClassificationModule: any classifier `nn.Module`, CrossEntropy, metrics, optimizer and schedule (optim.py)."""

from typing import Literal

import lightning as L
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import Tensor, nn
from torchmetrics import MaxMetric, MeanMetric, MetricCollection
from torchmetrics.classification import MulticlassAccuracy

from project import optim
from project.errors import ConfigError
from project.versions import built_by_cli

Inputs = Tensor | tuple | list | dict  # images (B, C, H, W), or the model's arguments from a collate_fn


class ClassificationModule(L.LightningModule):
    """Trains `model` to classify images (or any inputs: docs/data.md).

    Args:
        model: any `nn.Module` mapping a (B, C, H, W) float batch (or tuple/list: model(*x), dict: model(**x)) to
            (B, num_classes) raw logits.
        num_classes: number of classes; linked from the data module by the CLI.
        input_shape: (C, H, W) of one input, used to check the model's output size before training; None skips it.
        optimizer: any torch optimizer, called with the parameter groups. Its `lr` is the peak learning rate, its
            `weight_decay` applies to `decay` only; Adam/AdamW run fused where they can, unless `fused: false`.
        scheduler: the lr schedule, stepped every optimizer step (ReduceLROnPlateau: every epoch, on the
            checkpoint's monitor); null keeps the lr constant.
        label_smoothing: CrossEntropy label smoothing.
        lr_scaling: `none` keeps every group's lr; `linear` multiplies it by the world size (devices x nodes).
        compile: compile the model in place (`nn.Module.compile()`); checkpoints keep plain `model.*` keys.
        channels_last: keep 4-D weights and image batches in NHWC memory format (faster convolutions on GPUs).
    """

    def __init__(
        self,
        model: nn.Module,
        num_classes: int,
        input_shape: tuple[int, int, int] | None = None,
        optimizer: OptimizerCallable = lambda params: torch.optim.AdamW(params, lr=0.003, weight_decay=0.05),
        scheduler: LRSchedulerCallable | None = optim.WarmupCosine,
        label_smoothing: float = 0.0,
        lr_scaling: Literal["none", "linear"] = "none",
        compile: bool = False,
        channels_last: bool = False,
    ) -> None:
        super().__init__()
        # Outside the CLI (which saves class_path + init_args) they would be pickled objects: not weights_only.
        self.save_hyperparameters(ignore=None if built_by_cli() else ["model", "optimizer", "scheduler"])
        self.model, self.num_classes, self.channels_last = model, num_classes, channels_last
        self.optimizer, self.scheduler, self.lr_scaling = optimizer, scheduler, lr_scaling
        self.loss_fn = nn.CrossEntropyLoss(label_smoothing=label_smoothing)
        if input_shape is not None:
            check_output_shape(model, tuple(input_shape), num_classes)
        # Before DDP wraps the model: its gradient buckets follow the parameters' storage at that time.
        if channels_last:
            model.to(memory_format=torch.channels_last)
        if compile:
            model.compile()  # in place: state_dict keys stay plain
        accuracy = {"acc": MulticlassAccuracy(num_classes, average="micro")}
        if num_classes > 5:
            accuracy["acc_top5"] = MulticlassAccuracy(num_classes, top_k=5, average="micro")
        self.val_metrics = MetricCollection(accuracy, prefix="val/", compute_groups=False)
        self.test_metrics = self.val_metrics.clone(prefix="test/")
        self.val_loss, self.test_loss, self.val_acc_best = MeanMetric(), MeanMetric(), MaxMetric()
        # Training loss and accuracy: summed on the device each step (cheaper than a torchmetrics update), folded
        # into these metrics at the epoch's end; a plain tensor (a buffer DDP would broadcast), Python int counts.
        self.train_loss, self.train_acc = MeanMetric(nan_strategy="disable"), MeanMetric()
        self._train = {"sums": None, "steps": 0, "samples": 0}

    def forward(self, x: Inputs) -> Tensor:
        if isinstance(x, Tensor):
            return self.model(x)
        return self.model(**x) if isinstance(x, dict) else self.model(*x)

    def setup(self, stage: str) -> None:
        # Labels checked once by the data module (data/validate.py) spare torchmetrics' per-batch check.
        checked = getattr(getattr(optim.attached_trainer(self), "datamodule", None), "labels_checked", False)
        for metric in self.modules():
            if isinstance(metric, MulticlassAccuracy):
                metric.validate_args = checked is not True

    def _shared_step(self, batch: tuple[Inputs, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        x, y = batch
        if self.channels_last and isinstance(x, Tensor) and x.ndim == 4:  # image batches only
            x = x.contiguous(memory_format=torch.channels_last)
        # Metrics and loss in float32 even under AMP: half-precision logits round argmax ties and sums.
        logits = self(x).float()
        return self.loss_fn(logits, y), logits, y

    def training_step(self, batch: tuple[Inputs, Tensor], batch_idx: int) -> Tensor:
        loss, logits, y = self._shared_step(batch)
        t = self._train
        sums = torch.stack((loss.detach(), (logits.argmax(dim=1) == y).sum().to(loss.dtype)))
        t["sums"] = sums if t["sums"] is None else t["sums"].add_(sums)
        t["steps"], t["samples"] = t["steps"] + 1, t["samples"] + y.numel()
        return loss

    def on_train_epoch_end(self) -> None:
        train = self._train
        if train["steps"]:
            loss_sum, correct = train["sums"]
            self.train_loss.update(loss_sum / train["steps"], weight=train["steps"])
            self.train_acc.update(correct / train["samples"], weight=train["samples"])
            self._train = {"sums": None, "steps": 0, "samples": 0}
        self.log_dict({"train/loss": self.train_loss, "train/acc": self.train_acc}, prog_bar=True)

    def validation_step(self, batch: tuple[Inputs, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, self.val_loss, self.val_metrics)

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:  # the untrained model's metrics are not logged
            self.val_loss.reset()
            self.val_metrics.reset()
            return
        self.val_acc_best.update(self.val_metrics["acc"].compute())
        self.log_dict({"val/loss": self.val_loss, **self.val_metrics}, prog_bar=True)
        # sync_dist only silences the DDP warning: the value is the same on every rank
        self.log("val/acc_best", self.val_acc_best.compute(), sync_dist=True)

    def test_step(self, batch: tuple[Inputs, Tensor], batch_idx: int) -> Tensor:
        # the float32 logits: RunReport reads them as on_test_batch_end's `outputs`
        return self._evaluate(batch, self.test_loss, self.test_metrics)

    def on_test_epoch_end(self) -> None:
        self.log_dict({"test/loss": self.test_loss, **self.test_metrics})

    def _evaluate(self, batch: tuple, mean_loss: MeanMetric, metrics: MetricCollection) -> Tensor:
        loss, logits, y = self._shared_step(batch)
        mean_loss.update(loss, weight=y.numel())  # a per-sample mean over uneven batches
        metrics.update(logits, y)
        return logits

    def param_groups(self) -> list[dict]:  # named for LearningRateMonitor's `lr-<Optimizer>/<name>`
        return decay_split([p for p in self.model.parameters() if p.requires_grad], "decay", "no_decay")

    def configure_optimizers(self) -> dict:
        world_size = getattr(optim.attached_trainer(self), "world_size", 1)
        return optim.configure(self, self.param_groups(), world_size if self.lr_scaling == "linear" else 1)

    def scaled_lr(self, world_size: int = 1) -> float:
        """The configured peak lr, times `world_size` under `lr_scaling: linear` (the CLI prints it for DDP)."""
        lr = self.optimizer([nn.Parameter(torch.zeros(1))]).defaults["lr"]
        return lr * (world_size if self.lr_scaling == "linear" else 1)

    def on_train_start(self) -> None:
        optim.start_schedules(self.trainer)


def decay_split(params: list, decay: str, no_decay: str, **extra) -> list[dict]:
    """Groups `decay` (weights) and `no_decay` (1-D: biases, norm scales, which decaying only hurts)."""
    return [
        {"name": decay, "params": [p for p in params if p.ndim > 1], **extra},
        {"name": no_decay, "params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0, **extra},
    ]


def check_output_shape(model: nn.Module, input_shape: tuple[int, ...], num_classes: int) -> None:
    """Fail before training, in one paragraph, when the model's head does not match the data's classes."""
    was_training, name = model.training, type(model).__name__
    model.eval()  # a dry run must not touch BatchNorm running statistics
    try:
        with torch.no_grad():
            out = model(torch.zeros(2, *input_shape, device=next(model.parameters(), torch.zeros(0)).device))
    except Exception as err:
        raise ConfigError(
            f"The model {name} failed on a dummy batch of shape (2, {', '.join(map(str, input_shape))}), the data's "
            f"input shape: {type(err).__name__}: {err}. Check its in_channels and image size against the data."
        ) from err
    finally:
        model.train(was_training)
    if not isinstance(out, Tensor) or out.ndim != 2 or out.shape[1] != num_classes:
        raise ConfigError(
            f"The model {name} returns outputs of shape {tuple(getattr(out, 'shape', ())) or type(out).__name__}, "
            f"but the data has {num_classes} classes, so (batch, {num_classes}) was expected. Give the model a "
            "`num_classes` argument (the CLI fills it in from the data), or set its head size to match: "
            "--model.init_args.model.init_args.num_classes."
        )

"""ClassificationModule: any classifier `nn.Module` + CrossEntropy + metrics + optimizer groups and schedule
(default: fused AdamW from project/optim.py, warmup then cosine from project/schedule.py, stepped per step)."""

from functools import partial
from typing import Literal

import lightning as L
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import Tensor, nn
from torch.optim.lr_scheduler import ReduceLROnPlateau
from torchmetrics import MaxMetric, MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from project import optim
from project.models.output_check import check_output_shape
from project.schedule import WarmupCosine, start_schedules
from project.versions import built_by_cli

# A batch's inputs from the collate_fn: images (B, C, H, W), or a tensor, tuple/list or dict of model arguments.
Inputs = Tensor | tuple | list | dict


class ClassificationModule(L.LightningModule):
    """Trains `model` to classify images (or any inputs: docs/data.md).

    Args:
        model: any `nn.Module` mapping a (B, C, H, W) float batch to (B, num_classes) raw logits. Tuple or list
            inputs are passed as model(*inputs), dict inputs as model(**inputs).
        num_classes: number of classes; linked from the data module by the CLI.
        input_shape: (C, H, W) of one input, used to check the model's output size before training; None skips it.
        optimizer: any torch optimizer, called with the parameter groups. Its `lr` is the peak learning rate, its
            `weight_decay` applies to `decay` only; Adam/AdamW run fused where they can, unless `fused: false`.
        scheduler: the learning-rate schedule, stepped every optimizer step (ReduceLROnPlateau: every epoch, on
            the checkpoint's monitor, `--monitor`: val/loss); null keeps the lr constant. Default: project.schedule.WarmupCosine.
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
        scheduler: LRSchedulerCallable | None = WarmupCosine,
        label_smoothing: float = 0.0,
        lr_scaling: Literal["none", "linear"] = "none",
        compile: bool = False,
        channels_last: bool = False,
    ) -> None:
        super().__init__()
        # The CLI saves model, optimizer and scheduler as class_path + init_args, so load_from_checkpoint rebuilds
        # them; outside it, pickled objects would make the checkpoint unloadable with weights_only=True.
        self.save_hyperparameters(ignore=None if built_by_cli() else ["model", "optimizer", "scheduler"])
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.num_classes = num_classes
        self.input_shape = tuple(input_shape) if input_shape is not None else None
        self.loss_fn = nn.CrossEntropyLoss(label_smoothing=label_smoothing)
        if self.input_shape is not None:
            check_output_shape(model, self.input_shape, num_classes)
        acc = partial(MulticlassAccuracy, num_classes=num_classes, average="micro")
        self.val_acc, self.test_acc = acc(), acc()
        self.top5 = num_classes > 5
        if self.top5:
            self.val_acc5, self.test_acc5 = acc(top_k=5), acc(top_k=5)
        # Training loss and accuracy: summed on the device each step (cheaper than a torchmetrics update per step),
        # folded in at the epoch's end, where Lightning syncs them. A NaN loss stops the run (NonFiniteLossGuard).
        self.train_loss = MeanMetric(nan_strategy="disable")  # the mean of the steps' losses
        self.train_acc = MeanMetric()  # correct / samples: micro accuracy, as val_acc and test_acc
        # sums (loss sum, correct): a plain tensor, not a buffer, which DDP would broadcast at every forward; steps
        # and samples: Python ints (no host sync). One dict: one nn.Module attribute write per step, not three.
        self._train = {"sums": None, "steps": 0, "samples": 0}
        self.val_loss, self.test_loss = MeanMetric(), MeanMetric()
        self.val_acc_best = MaxMetric()
        self._model_compiled = False

    def forward(self, x: Inputs) -> Tensor:
        """The model on a batch's inputs: model(x) for a tensor, model(*x) for a tuple or list, model(**x) for a dict."""
        if isinstance(x, Tensor):
            return self.model(x)
        if isinstance(x, dict):
            return self.model(**x)
        return self.model(*x)

    def setup(self, stage: str) -> None:
        # Before the strategy wraps the model in DDP, whose gradient buckets follow the parameters' storage then:
        # converted later, a 2-process run no longer matched the one-process run (tests/test_ddp.py).
        if self.hparams.get("channels_last"):
            self.model.to(memory_format=torch.channels_last)
        if self.hparams.get("compile") and not self._model_compiled:
            self.model.compile()  # lazy: dynamo traces on the first forward
            self._model_compiled = True
        datamodule = self.attached_trainer().datamodule if self.attached_trainer() else None
        # A data module that checked every label once (project/data/validate.py) spares torchmetrics' per-batch
        # check; CrossEntropy still raises on labels outside [0, num_classes) other than its ignore_index, -100.
        labels_checked = getattr(datamodule, "labels_checked", False) is True
        for metric in self.modules():
            if isinstance(metric, MulticlassAccuracy):
                metric.validate_args = not labels_checked

    def _shared_step(self, batch: tuple[Inputs, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        x, y = batch
        if self.hparams.get("channels_last") and isinstance(x, Tensor) and x.ndim == 4:  # image batches only
            x = x.contiguous(memory_format=torch.channels_last)
        # Metrics and loss in float32 even under AMP: half-precision logits round argmax ties and sums.
        logits = self(x).float()
        return self.loss_fn(logits, y), logits, y

    def training_step(self, batch: tuple[Inputs, Tensor], batch_idx: int) -> Tensor:
        loss, logits, y = self._shared_step(batch)
        self._add_to_train_sums(loss, logits, y)
        return loss

    def _add_to_train_sums(self, loss: Tensor, logits: Tensor, y: Tensor) -> None:
        """One step's loss and correct predictions, added on the device."""
        train = self._train
        # detached: no graph for the sums (argmax has no gradient); no `torch.no_grad()`, a context per step
        sums = torch.stack((loss.detach(), (logits.argmax(dim=1) == y).sum().to(loss.dtype)))
        train["sums"] = sums if train["sums"] is None else train["sums"].add_(sums)
        train["steps"] += 1
        train["samples"] += y.numel()

    def on_train_epoch_end(self) -> None:
        # Logged once per epoch: a per-step self.log costs a host sync each step.
        train = self._train
        if train["steps"]:
            loss_sum, correct = train["sums"]
            self.train_loss.update(loss_sum / train["steps"], weight=train["steps"])
            self.train_acc.update(correct / train["samples"], weight=train["samples"])
            self._train = {"sums": None, "steps": 0, "samples": 0}
        self._log_metrics({"train/loss": "train_loss", "train/acc": "train_acc"}, prog_bar=True)

    def validation_step(self, batch: tuple[Inputs, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:
            # The untrained model's numbers: not logged, so epoch 0's progress bar shows no stale val/acc
            for metric in (self.val_loss, self.val_acc, *((self.val_acc5,) if self.top5 else ())):
                metric.reset()
            return
        self.val_acc_best.update(self.val_acc.compute())
        metrics = {"val/loss": "val_loss", "val/acc": "val_acc"}
        if self.top5:
            metrics["val/acc_top5"] = "val_acc5"
        self._log_metrics(metrics, prog_bar=True)
        # Same value on every rank (from synced val/acc); sync_dist only silences the DDP warning.
        self.log("val/acc_best", self.val_acc_best.compute(), sync_dist=True)

    def test_step(self, batch: tuple[Inputs, Tensor], batch_idx: int) -> Tensor:
        """Update the test metrics; return the float32 logits (batch, num_classes): RunReport reads them as the
        `outputs` of on_test_batch_end instead of running the model again."""
        return self._evaluate(batch, "test")

    def _evaluate(self, batch: tuple[Inputs, Tensor], stage: str) -> Tensor:
        """Update `<stage>_loss`, `<stage>_acc` (and `<stage>_acc5`) with one batch; return its float32 logits."""
        loss, logits, y = self._shared_step(batch)
        getattr(self, f"{stage}_loss").update(loss, weight=y.numel())
        getattr(self, f"{stage}_acc").update(logits, y)
        if self.top5:
            getattr(self, f"{stage}_acc5").update(logits, y)
        return logits

    def on_test_epoch_end(self) -> None:
        metrics = {"test/loss": "test_loss", "test/acc": "test_acc"}
        if self.top5:
            metrics["test/acc_top5"] = "test_acc5"
        self._log_metrics(metrics)

    def _log_metrics(self, keys: dict[str, str], **kwargs) -> None:
        """Log metric objects ({log key: attribute name}); Lightning computes, syncs and resets them. Naming the
        attribute spares Lightning's isinstance(Metric) search over every submodule on the first log call."""
        for key, attribute in keys.items():
            self.log(key, getattr(self, attribute), metric_attribute=attribute, **kwargs)

    def param_groups(self) -> list[dict]:
        """`decay` (weights) and `no_decay` (1-D: biases, norm scales), named for LearningRateMonitor's
        `lr-<Optimizer>/<name>`; a group without `weight_decay` or `lr` takes the optimizer's (FinetuneModule's own)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        return [  # biases and norm scales are 1-D: decaying them only hurts
            {"name": "decay", "params": [p for p in params if p.ndim > 1]},
            {"name": "no_decay", "params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0},
        ]

    def attached_trainer(self) -> "L.Trainer | None":
        """The Trainer running this module, or None when it is used on its own (a test, an export)."""
        try:
            return self.trainer
        except RuntimeError:  # Lightning: "... is not attached to a `Trainer`"
            return None

    def configure_optimizers(self):
        trainer = self.attached_trainer()
        allow_fused = not optim.clips_under_amp(trainer)
        optimizer = optim.build_optimizer(self.optimizer, self.param_groups(), allow_fused=allow_fused)
        world_size = trainer.world_size if trainer is not None else 1
        optim.scale_lr(optimizer, self.lr_scale(world_size))  # before the scheduler records each group's peak
        if self.scheduler is None:
            return optimizer
        scheduler = self.scheduler(optimizer)
        config = {"scheduler": scheduler, "interval": "step"}
        if isinstance(scheduler, ReduceLROnPlateau):  # it needs a metric: the checkpoint-selection one
            monitor = getattr(getattr(trainer, "checkpoint_callback", None), "monitor", None)
            config.update(interval="epoch", monitor=monitor or "val/loss")
        return {"optimizer": optimizer, "lr_scheduler": config}

    def lr_scale(self, world_size: int) -> int:
        """The factor on every group's lr for `world_size` processes: world_size with lr_scaling=linear, else 1."""
        return optim.lr_scale(self.hparams.get("lr_scaling", "none"), world_size)

    def configured_lr(self) -> float:
        """The optimizer's lr as configured (before lr_scaling)."""
        return optim.configured_lr(self.optimizer)

    def scaled_lr(self, world_size: int) -> float:
        """The peak lr for `world_size` processes (DDP): the optimizer's lr, times world_size with lr_scaling=linear."""
        return self.configured_lr() * self.lr_scale(world_size)

    def on_train_start(self) -> None:
        start_schedules(self.trainer)  # the train loader is set up (and restored, on resume) by now

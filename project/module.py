"""ClassificationModule: any image classifier `nn.Module` + CrossEntropy + a configured optimizer and schedule.

Defaults: AdamW (torch's fused kernel where it has one) with two named parameter groups, linear warmup then cosine
(project/schedule.py), stepped every optimizer step.
"""

from functools import partial
from typing import Literal

import lightning as L
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import Tensor, nn
from torch.optim.lr_scheduler import ReduceLROnPlateau
from torchmetrics import MaxMetric, MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from project.models.output_check import check_output_shape
from project.optim import build_optimizer, clips_under_amp
from project.schedule import WarmupCosine, start_schedules
from project.versions import built_by_cli

# A batch's inputs, as the data module's collate_fn makes them: an image batch (B, C, H, W), or for other data a
# tensor, a tuple/list of model arguments or a dict of keyword arguments (project/data/dataset_module.py).
Inputs = Tensor | tuple | list | dict


class ClassificationModule(L.LightningModule):
    """Trains `model` to classify images.

    Parameter groups, each with a `name` (LearningRateMonitor logs `lr-<Optimizer>/<name>`):
    `decay` (weights, the optimizer's weight_decay) and `no_decay` (1-D parameters: biases and norm scales,
    weight_decay 0). project/finetune.py's FinetuneModule uses `backbone`, `backbone_no_decay`, `head`,
    `head_no_decay` instead.

    Args:
        model: any `nn.Module` mapping a (B, C, H, W) float batch to (B, num_classes) logits. Return raw
            logits: CrossEntropy applies log-softmax itself. Batches are (inputs, labels); inputs that are not
            one tensor (a DatasetDataModule's collate_fn may make them) are passed as model(*inputs) for a tuple
            or list and model(**inputs) for a dict.
        num_classes: number of classes; linked from the data module by the CLI.
        input_shape: (C, H, W) of one input; linked from the data module and used to check the model's
            output size before training starts. None (data that is not images) skips the check.
        optimizer: any torch optimizer, called with the parameter groups (LightningCLI's `OptimizerCallable`:
            `class_path` + `init_args` in the config). Its `lr` is the peak learning rate and its `weight_decay`
            applies to the `decay` group only. Adam and AdamW with `fused` unset use torch's fused kernel when
            every parameter is a float on CPU or CUDA; `fused: false` keeps torch's default loop.
        scheduler: the learning-rate schedule (LightningCLI's `LRSchedulerCallable`), stepped after every
            optimizer step; `ReduceLROnPlateau` is stepped per epoch on `val/loss`; null keeps the lr constant.
            Default: project.schedule.WarmupCosine (`warmup_epochs`, `min_lr_ratio`).
        label_smoothing: CrossEntropy label smoothing.
        lr_scaling: `none` keeps every group's lr whatever the number of processes; `linear` multiplies them by the
            world size (devices x nodes), the linear scaling rule for a global batch that grows with the processes.
        compile: compile the model in place with `nn.Module.compile()` when a Trainer sets the module up (fit,
            validate, test). The parameters stay the model's own, so checkpoints keep the plain `model.*` keys
            and load into an uncompiled model (no `_orig_mod.` prefix, as `torch.compile(model)` would add).
            `make bench` reports its compile time and steady-state speed.
        channels_last: keep weights and image batches in NHWC memory format (faster convolutions on GPUs
            with tensor cores; `make bench` shows its effect). Only 4-D weights and 4-D input tensors change:
            other inputs and layers (a GRU's, a linear head's) are left as they are.

    Labels are checked once by the image data modules (`labels_checked`), so torchmetrics' per-batch check (a third
    of a metric update) is off for them; CrossEntropy raises on labels outside [0, num_classes) except -100.
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
        # With LightningCLI the nested configs are saved (model, optimizer and scheduler as class_path +
        # init_args), so load_from_checkpoint rebuilds them without repeating the config. Outside the CLI there
        # is no config to save for them, and pickling the objects themselves would make the checkpoint
        # unloadable with weights_only=True.
        from_cli = built_by_cli()
        self.save_hyperparameters(ignore=None if from_cli else ["model", "optimizer", "scheduler"])
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
        # Training loss and accuracy: each step adds to two sums on the device (no host sync), folded into these
        # metrics at the epoch's end, where Lightning syncs them across processes (a torchmetrics update per
        # step costs more host time: `make bench`). NonFiniteLossGuard stops the run on a NaN loss.
        self.train_loss = MeanMetric(nan_strategy="disable")  # the mean of the steps' losses
        self.train_acc = MeanMetric()  # correct / samples: micro accuracy, as val_acc and test_acc
        # sums: (loss sum, correct predictions) on the loss's device, a plain tensor, not a buffer, which DDP would
        # broadcast from rank 0 at every forward; steps and samples: Python ints (no host sync). In a dict: one
        # nn.Module attribute write per step instead of three.
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
        # Before the strategy moves the model and wraps it in DDP, which sets up its gradient buckets for the
        # parameters' storage as it is then. Converted later (in on_fit_start), a 2-process run ended with
        # weights 0.12 away from the equivalent one-process run (tests/test_ddp.py) instead of matching it.
        if self.hparams.get("channels_last"):
            self.model.to(memory_format=torch.channels_last)
        if self.hparams.get("compile") and not self._model_compiled:
            self.model.compile()  # lazy: dynamo traces on the first forward
            self._model_compiled = True
        datamodule = self._trainer.datamodule if self._trainer is not None else None
        # True: the data module checked every label once (project/data/validate.py); torchmetrics' per-batch check
        # of the shapes (and, for integer predictions only, the values) is then skipped.
        labels_checked = getattr(datamodule, "labels_checked", False) is True
        for metric in self.modules():
            if isinstance(metric, MulticlassAccuracy):
                metric.validate_args = not labels_checked  # see "Labels" in the class docstring

    def _shared_step(self, batch: tuple[Inputs, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        x, y = batch
        if self.hparams.get("channels_last") and isinstance(x, Tensor) and x.ndim == 4:  # image batches only
            x = x.contiguous(memory_format=torch.channels_last)
        logits = self(x)
        # Metrics and loss in float32 even under AMP: half-precision logits round argmax ties and sums.
        logits = logits.float()
        return self.loss_fn(logits, y), logits, y

    def training_step(self, batch: tuple[Inputs, Tensor], batch_idx: int) -> Tensor:
        loss, logits, y = self._shared_step(batch)
        self._add_to_train_sums(loss, logits, y)
        return loss

    def _add_to_train_sums(self, loss: Tensor, logits: Tensor, y: Tensor) -> None:
        """One step's loss and correct predictions, added on the device (`make bench` times this method)."""
        train = self._train
        # detached: no graph for the sums (argmax has no gradient); no `torch.no_grad()`, a context per step
        sums = torch.stack((loss.detach(), (logits.argmax(dim=1) == y).sum().to(loss.dtype)))
        train["sums"] = sums if train["sums"] is None else train["sums"].add_(sums)
        train["steps"] += 1
        train["samples"] += y.numel()

    def on_train_epoch_end(self) -> None:
        # Logged once per epoch: a per-step self.log costs a host sync each step (see `make bench`).
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
        acc = self.val_acc.compute()
        self.val_acc_best.update(acc)
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
        """Log metric objects ({log key: attribute name}); Lightning computes, syncs and resets them.

        Naming the attribute spares Lightning's search for it (isinstance(module, Metric) over every submodule on
        the first log call: ABC subclass checks against torchmetrics' hundreds of Metric classes).
        """
        for key, attribute in keys.items():
            self.log(key, getattr(self, attribute), metric_attribute=attribute, **kwargs)

    def param_groups(self) -> list[dict]:
        """Named parameter groups for the optimizer (FinetuneModule overrides this with per-part groups).

        A group without `weight_decay` or `lr` takes the optimizer's own.
        """
        decay, no_decay = [], []
        for p in self.model.parameters():
            if p.requires_grad:
                # Biases and norm scales are 1-D: decaying them only hurts.
                (decay if p.ndim > 1 else no_decay).append(p)
        return [
            {"name": "decay", "params": decay},
            {"name": "no_decay", "params": no_decay, "weight_decay": 0.0},
        ]

    def configure_optimizers(self):
        world_size = self._trainer.world_size if self._trainer is not None else 1
        optimizer = build_optimizer(
            self.optimizer, self.param_groups(), allow_fused=not clips_under_amp(self._trainer)
        )
        scale = self.lr_scale(world_size)
        if scale != 1:  # before the scheduler records each group's peak (initial_lr)
            for group in optimizer.param_groups:
                group["lr"] *= scale
            optimizer.defaults["lr"] *= scale
        if self.scheduler is None:
            return optimizer
        scheduler = self.scheduler(optimizer)
        if isinstance(scheduler, ReduceLROnPlateau):  # it needs a metric: the checkpoint-selection one
            config = {"scheduler": scheduler, "interval": "epoch", "monitor": "val/loss"}
        else:
            config = {"scheduler": scheduler, "interval": "step"}
        return {"optimizer": optimizer, "lr_scheduler": config}

    def lr_scale(self, world_size: int) -> int:
        """The factor on every group's lr for `world_size` processes: world_size with lr_scaling=linear, else 1."""
        return world_size if self.hparams.get("lr_scaling", "none") == "linear" else 1

    def configured_lr(self) -> float:
        """The optimizer's lr as configured (before lr_scaling): the lr of an optimizer built on a stand-in."""
        return self.optimizer([nn.Parameter(torch.zeros(1))]).defaults["lr"]

    def scaled_lr(self, world_size: int) -> float:
        """The peak lr for `world_size` processes (DDP): the optimizer's lr, times world_size with lr_scaling=linear."""
        return self.configured_lr() * self.lr_scale(world_size)

    def on_train_start(self) -> None:
        start_schedules(self.trainer)  # the train loader is set up (and restored, on resume) by now

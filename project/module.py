"""ClassificationModule: any image classifier `nn.Module` + CrossEntropy + AdamW + warmup-cosine + metrics."""

from functools import partial
from typing import Literal

import lightning as L
import torch
from lightning.pytorch.core.mixins.hparams_mixin import _given_hyperparameters
from torch import Tensor, nn
from torch.optim.lr_scheduler import LambdaLR
from torchmetrics import MaxMetric, MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from project.errors import ConfigError
from project.schedule import warmup_cosine


class ClassificationModule(L.LightningModule):
    """Trains `model` to classify images.

    Args:
        model: any `nn.Module` mapping a (B, C, H, W) float batch to (B, num_classes) logits. Return raw
            logits: CrossEntropy applies log-softmax itself.
        num_classes: number of classes; linked from the data module by the CLI.
        input_shape: (C, H, W) of one input; linked from the data module and used to check the model's
            output size before training starts.
        lr: peak AdamW learning rate, reached after warmup.
        weight_decay: AdamW weight decay, applied to weights only (not biases or norm parameters).
        betas: AdamW betas.
        warmup_epochs: linear warmup length in epochs (fractions allowed).
        min_lr_ratio: the cosine ends at `lr * min_lr_ratio`.
        label_smoothing: CrossEntropy label smoothing.
        lr_scaling: `none` keeps `lr` whatever the number of processes; `linear` multiplies it by the world size
            (devices x nodes), the linear scaling rule for a global batch that grows with the processes.
        compile: run the model through torch.compile (compiled on the first step). Checkpoints keep the plain
            `model.*` keys, so they load into an uncompiled model (no `_orig_mod.` prefix, Lightning #20233).
            `make bench` reports its compile time and steady-state speed.
        channels_last: keep weights and image batches in NHWC memory format (faster convolutions on GPUs
            with tensor cores; `make bench` shows its effect).
    """

    def __init__(
        self,
        model: nn.Module,
        num_classes: int,
        input_shape: tuple[int, int, int] | None = None,
        lr: float = 3e-3,
        weight_decay: float = 0.05,
        betas: tuple[float, float] = (0.9, 0.999),
        warmup_epochs: float = 1.0,
        min_lr_ratio: float = 0.0,
        label_smoothing: float = 0.0,
        lr_scaling: Literal["none", "linear"] = "none",
        compile: bool = False,
        channels_last: bool = False,
    ) -> None:
        super().__init__()
        # With LightningCLI the nested model config is saved (not the module object), so
        # load_from_checkpoint rebuilds the model without repeating its config.
        # Outside the CLI there is no config to save for `model`, and pickling the module itself would
        # make the checkpoint unloadable with weights_only=True.
        self.save_hyperparameters(ignore=None if _given_hyperparameters.get() is not None else ["model"])
        self.model = model
        self.num_classes = num_classes
        self.input_shape = tuple(input_shape) if input_shape is not None else None
        self.loss_fn = nn.CrossEntropyLoss(label_smoothing=label_smoothing)
        if self.input_shape is not None:
            check_output_shape(model, self.input_shape, num_classes)

        # validate_args=False: torchmetrics' per-batch label checks (a third of an update, ~65 us a training
        # step here) repeat what the data module checked once before training (project/data/validate.py).
        acc = partial(MulticlassAccuracy, num_classes=num_classes, average="micro", validate_args=False)
        self.train_acc, self.val_acc, self.test_acc = acc(), acc(), acc()
        self.top5 = num_classes > 5
        if self.top5:
            self.val_acc5, self.test_acc5 = acc(top_k=5), acc(top_k=5)
        # The training loss needs no NaN check of its own: NonFiniteLossGuard stops the run on one.
        self.train_loss = MeanMetric(nan_strategy="disable")
        self.val_loss, self.test_loss = MeanMetric(), MeanMetric()
        self.val_acc_best = MaxMetric()
        self.total_steps: int | None = None  # known once the train loader exists; see on_train_start
        # The compiled wrapper is kept out of the module tree (not a registered submodule), so state_dict
        # keys stay `model.*` and checkpoints load into an uncompiled model.
        self.__dict__["_compiled"] = None

    def forward(self, x: Tensor) -> Tensor:
        if self.hparams.get("compile") and self._compiled is None:
            self.__dict__["_compiled"] = torch.compile(self.model)
        return (self._compiled if self._compiled is not None else self.model)(x)

    def setup(self, stage: str) -> None:
        # Before the strategy moves the model and wraps it in DDP, which sets up its gradient buckets for the
        # parameters' storage as it is then. Converted later (in on_fit_start), a 2-process run ended with
        # weights 0.12 away from the equivalent one-process run (tests/test_ddp.py) instead of matching it.
        if self.hparams.get("channels_last"):
            self.model.to(memory_format=torch.channels_last)

    def _shared_step(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        x, y = batch
        if self.hparams.get("channels_last"):
            x = x.contiguous(memory_format=torch.channels_last)
        logits = self(x)
        # Metrics and loss in float32 even under AMP: half-precision logits round argmax ties and sums.
        logits = logits.float()
        return self.loss_fn(logits, y), logits, y

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss, logits, y = self._shared_step(batch)
        self.train_loss.update(loss.detach())
        self.train_acc.update(logits.detach(), y)
        return loss

    def on_train_epoch_end(self) -> None:
        # Logged once per epoch: a per-step self.log costs a host sync each step (see `make bench`).
        self._log_metrics({"train/loss": "train_loss", "train/acc": "train_acc"}, prog_bar=True)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        loss, logits, y = self._shared_step(batch)
        self.val_loss.update(loss, weight=y.numel())
        self.val_acc.update(logits, y)
        if self.top5:
            self.val_acc5.update(logits, y)

    def on_validation_epoch_end(self) -> None:
        acc = self.val_acc.compute()
        if not self.trainer.sanity_checking:
            self.val_acc_best.update(acc)
        metrics = {"val/loss": "val_loss", "val/acc": "val_acc"}
        if self.top5:
            metrics["val/acc_top5"] = "val_acc5"
        self._log_metrics(metrics, prog_bar=True)
        if not self.trainer.sanity_checking:
            # Same value on every rank (from synced val/acc); sync_dist only silences the DDP warning.
            self.log("val/acc_best", self.val_acc_best.compute(), sync_dist=True)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss, logits, y = self._shared_step(batch)
        self.test_loss.update(loss, weight=y.numel())
        self.test_acc.update(logits, y)
        if self.top5:
            self.test_acc5.update(logits, y)
        return logits  # for callbacks: RunReport's confusion matrix and wrong examples reuse them

    def on_test_epoch_end(self) -> None:
        metrics = {"test/loss": "test_loss", "test/acc": "test_acc"}
        if self.top5:
            metrics["test/acc_top5"] = "test_acc5"
        self._log_metrics(metrics)

    def _log_metrics(self, keys: dict[str, str], **kwargs) -> None:
        """Log metric objects ({log key: attribute name}); Lightning computes, syncs and resets them.

        Naming the attribute spares Lightning's search for it: on the first log call that search runs
        isinstance(module, Metric) over every submodule, a one-off 0.1-0.2 s of ABC subclass checks against
        torchmetrics' hundreds of Metric classes on 2 CPU cores.
        """
        for key, attribute in keys.items():
            self.log(key, getattr(self, attribute), metric_attribute=attribute, **kwargs)

    def predict_step(self, batch: Tensor | tuple[Tensor, ...], batch_idx: int) -> Tensor:
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self(x).float().softmax(dim=-1)

    def param_groups(self) -> list[dict]:
        """AdamW parameter groups (project/finetune.py overrides this to give the backbone its own LR)."""
        decay, no_decay = [], []
        for p in self.model.parameters():
            if p.requires_grad:
                # Biases and norm scales are 1-D: decaying them only hurts.
                (decay if p.ndim > 1 else no_decay).append(p)
        return [
            {"params": decay, "weight_decay": self.hparams.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]

    def configure_optimizers(self):
        world_size = self._trainer.world_size if self._trainer is not None else 1
        groups = self.param_groups()
        optimizer = torch.optim.AdamW(
            groups, lr=self.scaled_lr(world_size), betas=self.hparams.betas, fused=fused_supported(groups)
        )
        scheduler = LambdaLR(optimizer, self._lr_factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def scaled_lr(self, world_size: int) -> float:
        """The peak lr for `world_size` processes (DDP): `lr`, times world_size with lr_scaling=linear."""
        return self.hparams.lr * (world_size if self.hparams.get("lr_scaling", "none") == "linear" else 1)

    def _lr_factor(self, step: int) -> float:
        if self.total_steps is None:
            # Called once when the scheduler is built, before the train loader exists. Asking for
            # trainer.estimated_stepping_batches here would reset a restored loader (Lightning #20550).
            return 0.0
        warmup = round(self.hparams.warmup_epochs * self.total_steps / max(1, self.trainer.max_epochs or 1))
        return warmup_cosine(step, warmup, self.total_steps, self.hparams.min_lr_ratio)

    def on_train_start(self) -> None:
        # The train loader is set up (and restored, on resume) by now, so this cannot reset it.
        self.total_steps = int(self.trainer.estimated_stepping_batches)
        for config in self.trainer.lr_scheduler_configs:
            scheduler = config.scheduler  # re-apply the factor of the current step, now that it is known
            for group, base_lr in zip(scheduler.optimizer.param_groups, scheduler.base_lrs):
                group["lr"] = base_lr * self._lr_factor(scheduler.last_epoch)
            scheduler._last_lr = [g["lr"] for g in scheduler.optimizer.param_groups]


def fused_supported(groups: list[dict]) -> bool:
    """Whether torch's fused AdamW kernel can update these parameters (floating point, on CPU or CUDA).

    One kernel for all parameters instead of a loop over them: the same update, and on the digits ConvNet
    (2 CPU cores) the optimizer step took 0.34 ms instead of 1.1 ms, ~5% of a training step (`make bench`).
    Other devices (MPS, XLA) keep the default implementation.
    """
    params = [p for g in groups for p in g["params"]]
    return bool(params) and all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)


def check_output_shape(model: nn.Module, input_shape: tuple[int, ...], num_classes: int) -> None:
    """Fail before training when the model's head does not match the data's classes."""
    try:
        device = next(model.parameters()).device
    except StopIteration:
        device = torch.device("cpu")
    was_training = model.training
    model.eval()  # eval: a dry run must not touch BatchNorm running statistics
    try:
        with torch.no_grad():
            out = model(torch.zeros(2, *input_shape, device=device))
    except Exception as err:
        raise ConfigError(
            f"The model {type(model).__name__} failed on a dummy batch of shape (2, {', '.join(map(str, input_shape))}), "
            f"the data module's input shape: {type(err).__name__}: {err}. "
            "Check the model's in_channels and expected image size against the data."
        ) from err
    finally:
        model.train(was_training)
    if not isinstance(out, Tensor) or out.ndim != 2 or out.shape[1] != num_classes:
        shape = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
        raise ConfigError(
            f"The model {type(model).__name__} returns outputs of shape {shape}, but the data has "
            f"{num_classes} classes, so (batch, {num_classes}) was expected. Give the model a `num_classes` "
            "constructor argument (the CLI fills it in from the data), or set its head size to match: "
            "--model.init_args.model.init_args.num_classes."
        )

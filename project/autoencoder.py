"""DenoisingAutoencoder: another task on the same data, trainer and callbacks (configs/autoencoder.yaml).

The CLI takes any `L.LightningModule` by `model.class_path`; this one shows what a task needs from the template:
a loss, metrics logged as `val/loss` (what the checkpoint selects on) and `test/loss`, and an optimizer with the
template's schedule. The labels the image data modules yield are ignored: the target is the clean image.
"""

import math

import lightning as L
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import Tensor, nn
from torchmetrics import MeanMetric

from project.optim import build_optimizer, clips_under_amp
from project.schedule import WarmupCosine, start_schedules


class DenoisingAutoencoder(L.LightningModule):
    """Reconstructs each image from a copy with Gaussian noise added: an MLP bottleneck, mean squared error.

    Args:
        input_shape: (C, H, W) of one image; linked from the data module by the CLI.
        code_size: width of the bottleneck.
        noise_std: standard deviation of the noise, in normalised pixel units (the data module standardises
            pixels to mean 0, std 1 per channel); 0 makes it a plain autoencoder.
        optimizer: any torch optimizer (`class_path` + `init_args`), called with the parameters.
        scheduler: the learning-rate schedule, stepped every optimizer step; null keeps the lr constant.
    """

    def __init__(
        self,
        input_shape: tuple[int, int, int],
        code_size: int = 16,
        noise_std: float = 0.5,
        optimizer: OptimizerCallable = lambda params: torch.optim.AdamW(params, lr=0.003, weight_decay=0.0),
        scheduler: LRSchedulerCallable | None = WarmupCosine,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])
        self.optimizer, self.scheduler = optimizer, scheduler
        pixels = math.prod(input_shape)
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(pixels, 128),
            nn.GELU(),
            nn.Linear(128, code_size),
            nn.GELU(),
            nn.Linear(code_size, 128),
            nn.GELU(),
            nn.Linear(128, pixels),
            nn.Unflatten(1, tuple(input_shape)),
        )
        self.train_loss, self.val_loss, self.test_loss = MeanMetric(), MeanMetric(), MeanMetric()

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def _loss(self, batch: tuple[Tensor, Tensor], noisy: bool) -> tuple[Tensor, int]:
        x, _ = batch  # the class labels play no part
        x = x.float()  # metrics and loss in float32, also under AMP
        seen = x + self.hparams.noise_std * torch.randn_like(x) if noisy else x
        return nn.functional.mse_loss(self(seen).float(), x), len(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss, n = self._loss(batch, noisy=True)
        self.train_loss.update(loss.detach(), weight=n)
        return loss

    def on_train_epoch_end(self) -> None:
        self.log("train/loss", self.train_loss, prog_bar=True)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        loss, n = self._loss(batch, noisy=True)  # the same task as training: denoise
        self.val_loss.update(loss, weight=n)  # per-sample mean over uneven batches

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:
            self.val_loss.reset()
            return
        self.log("val/loss", self.val_loss, prog_bar=True)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        loss, n = self._loss(batch, noisy=True)
        self.test_loss.update(loss, weight=n)

    def on_test_epoch_end(self) -> None:
        self.log("test/loss", self.test_loss)

    def configure_optimizers(self):
        optimizer = build_optimizer(
            self.optimizer,
            [{"params": list(self.parameters())}],
            allow_fused=not clips_under_amp(self.trainer),
        )
        if self.scheduler is None:
            return optimizer
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": self.scheduler(optimizer), "interval": "step"},
        }

    def on_train_start(self) -> None:
        start_schedules(self.trainer)

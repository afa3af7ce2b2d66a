"""DenoisingAutoencoder (configs/autoencoder.yaml): what another task needs from the template: a loss, `val/loss`
(what the checkpoint selects on) and `test/loss`, and the template's optimizer and schedule."""

import math

import lightning as L
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import Tensor, nn

from project import optim


class DenoisingAutoencoder(L.LightningModule):
    """Reconstructs each image from a copy with Gaussian noise added: an MLP bottleneck, mean squared error.

    Args:
        input_shape: (C, H, W) of one image; linked from the data module by the CLI.
        code_size: width of the bottleneck.
        noise_std: standard deviation of the noise, in normalised pixel units; 0 makes a plain autoencoder.
        optimizer: any torch optimizer (`class_path` + `init_args`), called with the parameters.
        scheduler: the learning-rate schedule, stepped every optimizer step; null keeps the lr constant.
    """

    def __init__(
        self,
        input_shape: tuple[int, int, int],
        code_size: int = 16,
        noise_std: float = 0.5,
        optimizer: OptimizerCallable = lambda params: torch.optim.AdamW(params, lr=0.003, weight_decay=0.0),
        scheduler: LRSchedulerCallable | None = optim.WarmupCosine,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])
        self.optimizer, self.scheduler = optimizer, scheduler
        pixels = math.prod(input_shape)
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(pixels, 128), nn.GELU(), nn.Linear(128, code_size), nn.GELU(),
            nn.Linear(code_size, 128), nn.GELU(), nn.Linear(128, pixels), nn.Unflatten(1, tuple(input_shape)),
        )  # fmt: skip

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def _step(self, batch: tuple[Tensor, Tensor], stage: str) -> Tensor:
        x = batch[0].float()  # the target is the clean image, not the label; float32 also under AMP
        loss = nn.functional.mse_loss(self(x + self.hparams.noise_std * torch.randn_like(x)).float(), x)
        if not self.trainer.sanity_checking:  # per sample over uneven batches and all ranks
            kwargs = dict(on_step=False, on_epoch=True, batch_size=len(x), sync_dist=True)
            self.log(f"{stage}/loss", loss, prog_bar=stage != "test", **kwargs)
        return loss

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._step(batch, "val")

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._step(batch, "test")

    def configure_optimizers(self) -> dict:
        return optim.configure(self, [{"params": list(self.parameters())}])

    def on_train_start(self) -> None:
        optim.start_schedules(self.trainer)

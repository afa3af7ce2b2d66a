"""What every data module of this project shares; the modules differ only in where their samples come from.

- `ClassificationData`: the class names (saved in every checkpoint and checked on resume), bad data failing in
  `prepare_data` (before Lightning's loggers write the run directory: docs/data.md "Bad input"), and the world size.
- `ImageData`: image batches arrive as pixels at the training size (uint8, or float in [0, 1]) from any path (a
  tensor in memory, files or tensors through a DataLoader, prepared chunks) and are augmented (training only,
  project/data/augment.py) and normalised (project/data/normalize.py) here, a whole batch at a time on the
  training device, by the same two functions on every path; the statistics, input shape and class names go into
  checkpoints for predict and export.
"""

import lightning as L
import torch
from torch import Tensor

from project.data.augment import augment_training_batch
from project.data.normalize import Normalize
from project.errors import ConfigError
from project.rng import run_seed


class ClassificationData(L.LightningDataModule):
    """A LightningDataModule with class names and setup-time checks."""

    class_names: list[str]

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def prepare_data(self) -> None:
        # Bad data fails before anything is written: Lightning creates the loggers' files in the run directory
        # between prepare_data and setup, so the data is loaded and checked here, on the first process of each
        # node; setup() keeps what it loaded, and the other processes load theirs in setup().
        fn = self.trainer.state.fn if self.trainer is not None else None
        self.setup(fn.value if fn is not None else None)

    def world_size(self) -> int:
        return self.trainer.world_size if self.trainer is not None else 1

    def describe_data(self) -> str:
        """How errors name this module's data."""
        return "the data"

    def state_dict(self) -> dict:
        return {"class_names": self.class_names}

    def load_state_dict(self, state: dict) -> None:
        if state.get("class_names") not in (None, self.class_names):
            raise ConfigError(
                f"The checkpoint was trained on classes {state['class_names']}, but {self.describe_data()} has "
                f"{self.class_names}. Resume with the data it was trained on, or start a new run."
            )


class ImageData(ClassificationData):
    """Image classification data: pixels in, augmented (training) and normalised float32 batches out."""

    labels_checked = True  # every label is checked to be in [0, num_classes) before training
    input_shape: tuple[int, int, int]  # (C, H, W) at the training size
    mean: list[float] | None = None  # the training split's per-channel statistics (project/data/stats.py)
    std: list[float] | None = None
    recipe: str = "none"  # the training augmentation (project/data/augment.py)
    _normalize: Normalize | None = None

    @property
    def in_channels(self) -> int:
        return self.input_shape[0]

    def on_after_batch_transfer(self, batch, dataloader_idx: int) -> tuple[Tensor, Tensor]:
        """Pixels on the device -> augmented (training) and normalised float32 (x, y)."""
        x, y = (batch["image"], batch["label"]) if isinstance(batch, dict) else batch
        trainer = self.trainer
        if self.recipe != "none" and trainer is not None and trainer.training:
            # A function of (seed, epoch, batch index in the epoch, rank) only: the same after a resume.
            b = trainer.fit_loop.epoch_loop.batch_progress.current.ready
            x = augment_training_batch(
                x, self.recipe, run_seed(), trainer.current_epoch, b, trainer.global_rank
            )
        if self._normalize is None:
            self._normalize = Normalize(self.mean, self.std)
        return self._normalize(x), y.long()

    def transfer_batch_to_device(self, batch, device: torch.device, dataloader_idx: int):
        # The in-memory loader builds batches on the training device already: skip Lightning's generic walk over
        # the batch. Anything else is moved as usual. (Here, not in the LightningModule: Lightning warns when a
        # module overrides it next to a data module.)
        if isinstance(batch, (tuple, list)) and all(
            isinstance(t, torch.Tensor) and t.device == device for t in batch
        ):
            return batch
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def state_dict(self) -> dict:
        # Saved in every checkpoint so prediction and export know the classes and the preprocessing.
        return {
            "class_names": self.class_names,
            "mean": self.mean,
            "std": self.std,
            "input_shape": list(self.input_shape),
        }

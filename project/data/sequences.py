"""A worked example for DatasetDataModule: the embedded digits as variable-length sequences, and their padding
collate (configs/sequence.yaml trains them with project/models/sequence.py). Nothing is downloaded."""

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import Dataset

from project.data import digits


class DigitPixelSequences(Dataset):
    """Each 8x8 digit as its ink pixels in reading order, one (row, column, intensity) step each, in [0, 1]: 16 to
    42 steps. DatasetDataModule and the CLI read the optional `classes`, `targets` and `in_channels`.

    Args:
        min_intensity: keep the pixels brighter than this (in [0, 1]; 0 keeps every pixel with ink).
    """

    classes = list(digits.CLASSES)
    in_channels = 3

    def __init__(self, min_intensity: float = 0.0) -> None:
        images, labels = digits.load_digits_tensors()
        rows, cols = torch.meshgrid(torch.arange(8.0), torch.arange(8.0), indexing="ij")
        grid = torch.stack([rows.flatten() / 7, cols.flatten() / 7], dim=1)  # (64, 2), row-major
        self.sequences: list[Tensor] = []
        for image in images.flatten(1):
            ink = image > min_intensity
            self.sequences.append(torch.cat([grid[ink], image[ink, None]], dim=1))  # (steps, 3) float32
        if min(len(s) for s in self.sequences) == 0:
            raise ValueError(
                f"min_intensity={min_intensity} leaves a digit without pixels: choose less than 1."
            )
        self.targets: list[int] = labels.tolist()

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int) -> tuple[Tensor, int]:
        return self.sequences[i], self.targets[i]


def pad_collate(batch: list[tuple[Tensor, int]]) -> tuple[dict[str, Tensor], Tensor]:
    """[(steps_i, features) sequence, label] -> ({"x": (B, max steps, features) zero-padded, "lengths": (B,)},
    labels): a dict, so the module calls `model(x=..., lengths=...)`."""
    sequences, labels = zip(*batch, strict=True)
    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.long)
    padded = pad_sequence(list(sequences), batch_first=True)  # zeros after each sequence's end
    return {"x": padded, "lengths": lengths}, torch.tensor(labels, dtype=torch.long)

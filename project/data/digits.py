"""The embedded default: scikit-learn's digits, 1,797 real 8x8 grey images of 10 classes. No download."""

import torch
from torch import Tensor

CLASSES = [str(d) for d in range(10)]
INPUT_SHAPE = (1, 8, 8)


def load_digits_tensors() -> tuple[Tensor, Tensor]:
    """Images as (1797, 1, 8, 8) float32 in [0, 1], labels as int64."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    # sklearn returns float64 pixels 0..16: float32 explicitly, never float64 into the model.
    images = torch.from_numpy(bunch.images).to(torch.float32).div_(16.0).unsqueeze(1)
    return images, torch.from_numpy(bunch.target).long()

"""The embedded default: 1,797 real 8x8 grey images of handwritten digits, 10 classes. `digits.csv.gz` is the UCI
"Optical Recognition of Handwritten Digits" test set (E. Alpaydin, C. Kaynak, 1998; CC BY 4.0,
https://doi.org/10.24432/C50P49) as scikit-learn ships it (`load_digits()`), read without scikit-learn and SciPy:
one image per row, 64 pixel counts 0..16 then the label."""

import gzip
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

CLASSES = [str(d) for d in range(10)]
INPUT_SHAPE = (1, 8, 8)
FILE = Path(__file__).with_name("digits.csv.gz")


def load_digits_tensors() -> tuple[Tensor, Tensor]:
    """Images as (1797, 1, 8, 8) float32 in [0, 1], labels as int64."""
    rows = np.loadtxt(gzip.decompress(FILE.read_bytes()).decode().splitlines(), delimiter=",", dtype=np.uint8)
    # float32 explicitly: numpy would give float64, which must never reach the model
    images = torch.from_numpy(rows[:, :64].copy()).to(torch.float32).div_(16.0).view(-1, *INPUT_SHAPE)
    return images, torch.from_numpy(rows[:, 64].astype(np.int64))

"""Image files -> uint8 (3, H, W) RGB tensors: torchvision.io.decode_image, the fastest decoder that
scripts/bench_decode.py measures and pixel for pixel what ImageFolder's PIL loader gives on JPEG and PNG."""

from pathlib import Path

import torch
from torch import Tensor

from project.data.normalize import resize


def load_image(path: str | Path) -> Tensor:
    from torchvision.io import ImageReadMode, decode_image

    try:
        x = decode_image(str(path), mode=ImageReadMode.RGB)
    except RuntimeError:  # a format torchvision does not decode (BMP, TIFF, ...): PIL, as ImageFolder
        from PIL import Image
        from torchvision.transforms.functional import pil_to_tensor

        with Image.open(path) as im:
            return pil_to_tensor(im.convert("RGB"))
    if x.ndim == 4:  # an animated GIF: every frame; PIL's loader gives the first
        x = x[0]
    return x if x.dtype == torch.uint8 else (x.to(torch.int32) >> 8).to(torch.uint8)  # 16-bit PNG: 8 bits


def load_image_at(path: str | Path, size: tuple[int, int] | None) -> Tensor:
    """An image file as every path serves it: at the training size (normalize.resize)."""
    return resize(load_image(path), size)

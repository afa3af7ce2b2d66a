"""Image files -> uint8 (3, H, W) RGB tensors: the decoder of the ImageFolder path.

`load_image` uses torchvision.io.decode_image (libjpeg-turbo, straight into a tensor), PIL for the formats it does
not read; its pixels are PIL's on JPEG and PNG (tests/data/test_decode.py).
"""

from pathlib import Path

import torch
from PIL import Image
from torch import Tensor


def pil_file(path: str | Path) -> Tensor:
    """PIL decode, converted to RGB as torchvision's ImageFolder loader does, as a (3, H, W) uint8 tensor."""
    with open(path, "rb") as f, Image.open(f) as im:
        return _pil_to_tensor(im.convert("RGB"))


def _pil_to_tensor(im: Image.Image) -> Tensor:
    pixels = torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8)
    return pixels.view(im.size[1], im.size[0], 3).permute(2, 0, 1)


def decode_image_file(path: str | Path) -> Tensor:
    """torchvision.io.decode_image of the file's bytes, in RGB; PIL for formats it does not read (BMP, TIFF...)."""
    from torchvision.io import ImageReadMode, decode_image, read_file

    try:
        x = decode_image(read_file(str(path)), mode=ImageReadMode.RGB)
    except (
        RuntimeError
    ):  # a format torchvision's decoders do not handle: PIL reads every format ImageFolder lists
        return pil_file(path)
    if x.ndim == 4:  # an animated GIF: every frame; PIL's loader gives the first
        x = x[0]
    if x.dtype != torch.uint8:  # 16-bit PNGs decode to uint16: scale to 8 bits
        x = (x.to(torch.int32) >> 8).to(torch.uint8)
    return x


def load_image(path: str | Path) -> Tensor:
    """The decoder: an image file as a (3, H, W) uint8 RGB tensor."""
    return decode_image_file(path)


def load_image_at(path: str | Path, size: tuple[int, int] | None) -> Tensor:
    """An image file as every path serves it: uint8 (3, H, W) RGB at the training size (normalize.resize)."""
    from project.data.normalize import resize

    return resize(load_image(path), size)

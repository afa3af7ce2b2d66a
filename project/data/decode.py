"""Image files -> uint8 (3, H, W) RGB tensors: the decoder of the ImageFolder path.

Candidates measured by scripts/bench_decode.py (docs/data.md "Point at your own data"): PIL, torchvision.io.decode_image
(libjpeg-turbo, straight into a tensor) and PIL with `Image.draft` (JPEG DCT-domain downscaling). DECODER names the
one `load_image` uses: decode_image, the fastest (`make bench-data`: decode.breakdown_ms_per_sample) and
pixel for pixel PIL's on JPEG and PNG (tests/data/test_decode.py). draft() is kept for the bench: it may only
scale by 1/2, 1/4 or 1/8 when the crop keeps at least the output size, which no crop of a 500x375 photo at 224 does.
"""

import math
from pathlib import Path

import torch
from PIL import Image
from torch import Tensor

DECODER = "decode_image"


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


def draft_scale(size: tuple[int, int], crop_h: int, crop_w: int, out: int) -> float:
    """The smallest JPEG DCT scale (1, 1/2, 1/4, 1/8) at which a (crop_h, crop_w) crop of an image of `size`
    (W, H) still has at least `out` pixels on each side: decoding smaller would throw away detail."""
    for scale in (1 / 8, 1 / 4, 1 / 2):
        if math.ceil(crop_h * scale) >= out and math.ceil(crop_w * scale) >= out:
            return scale
    return 1.0


def pil_draft_file(path: str | Path, params: tuple, out: int) -> tuple[Tensor, tuple]:
    """PIL decode with `draft` at the scale `draft_scale` allows for crop `params` = (i, j, h, w, flip); returns
    the decoded tensor and the crop mapped to its size."""
    i, j, h, w, flip = params
    with open(path, "rb") as f, Image.open(f) as im:
        full_w, full_h = im.size
        scale = draft_scale(im.size, h, w, out)
        if scale < 1 and im.format == "JPEG":
            im.draft("RGB", (math.ceil(full_w * scale), math.ceil(full_h * scale)))
        x = _pil_to_tensor(im.convert("RGB"))
    sy, sx = x.shape[1] / full_h, x.shape[2] / full_w
    return x, (round(i * sy), round(j * sx), max(1, round(h * sy)), max(1, round(w * sx)), flip)


def load_image(path: str | Path) -> Tensor:
    """The default decoder (DECODER): an image file as a (3, H, W) uint8 RGB tensor."""
    return decode_image_file(path)


def load_image_at(path: str | Path, size: tuple[int, int] | None) -> Tensor:
    """An image file as every path serves it: uint8 (3, H, W) RGB at the training size (normalize.resize)."""
    from project.data.normalize import resize

    return resize(load_image(path), size)

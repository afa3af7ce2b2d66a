"""Decode + augment throughput of one loader worker: torchvision's reference pipeline against the candidates.

    python scripts/bench_decode.py            # 5,000 generated JPEGs, 3 interleaved rounds
    python scripts/bench_decode.py --quick    # 500 JPEGs, 1 round (every key, rougher figures)

Writes (once, then reuses) an ImageNet-like folder under runs/bench_data/jpeg/train/<class>/*.jpg: 500x375 JPEGs
at quality 90, 80-140 KB each, whose content is natural-image-like (a colour gradient, overlapping blurred
shapes, and texture from noise at four scales; not white noise, which would not compress like a photo).

Per worker means one process, one thread (torch.set_num_threads(1)), num_workers=0: a DataLoader's worker runs
exactly this loop, so k workers give about k times it. Every pipeline runs over the same files, in interleaved
rounds (reference, candidate 1, ..., reference, ...), after one warm pass that puts the files in the page cache.
samples/s is per CPU second of this process (`time.process_time`), which a busy shared machine disturbs less than
wall-clock time; wall-clock figures are reported next to it.

Pipelines (all give a (3, 224, 224) sample per image and a normalised float32 batch of 64 in the end):
  reference      torchvision's ImageNet recipe: ImageFolder's PIL loader, RandomResizedCrop(224) on the PIL image,
                 RandomHorizontalFlip, ToTensor, Normalize per sample, default_collate of float32 samples.
  pil_uint8      PIL decode, the same crop/resize/flip as transforms v2 on the uint8 tensor, uint8 collate,
                 normalisation once per batch (project/data/normalize.py).
  decode_image   torchvision.io.decode_image on the file's bytes (libjpeg-turbo), then as pil_uint8.
  pil_draft      PIL with Image.draft (JPEG DCT-domain downscaling by 1/2, 1/4, 1/8) chosen per crop so that
                 the decoded crop still has at least 224 pixels on each side, then as pil_uint8.
  pil_pil_uint8  the reference's PIL crop+resize+flip, then uint8 tensor, uint8 collate, batch normalisation:
                 what moving ToTensor/Normalize out of the sample alone buys.

Same output: for each image, crop parameters (i, j, h, w) and the flip are drawn once and given to every
pipeline; the mean absolute difference of each candidate's output to the reference's, on the [0, 1] scale
before normalisation, is compared with what two resampling filters differ by on the reference path itself
(PIL bilinear vs PIL bicubic, same crop). A candidate passes when its difference is below that.

`run(quick)` returns a dict (scripts/bench_data.py puts it into `make bench-data`).
"""

import argparse
import functools
import io
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image, ImageDraw, ImageFilter  # noqa: E402

DATA = ROOT / "runs" / "bench_data" / "jpeg"
W, H, QUALITY, CLASSES, SIZE, BATCH = 500, 375, 90, 5, 224, 64
GENERATOR_VERSION = 1  # bump when natural_image changes: the folder is regenerated
IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


# ---------------------------------------------------------------- data


def _noise_bank(seed: int = 12345, n: int = 4) -> list[np.ndarray]:
    """Texture fields twice the image size: Gaussian noise at 32, 8, 2 and 1 pixel scales, bicubically smooth."""
    rng = np.random.default_rng(seed)
    bank = []
    for _ in range(n):
        acc = np.zeros((2 * H, 2 * W), np.float32)
        for scale, amp in ((32, 1.0), (8, 0.7), (2, 0.6), (1, 0.5)):
            hs, ws = 2 * H // scale + 2, 2 * W // scale + 2
            field = Image.fromarray(rng.standard_normal((hs, ws)).astype(np.float32))
            acc += amp * np.asarray(field.resize((ws * scale, hs * scale), Image.BICUBIC))[: 2 * H, : 2 * W]
        bank.append(acc)
    return bank


def natural_image(index: int, bank: list[np.ndarray]) -> Image.Image:
    """A photo-like 500x375 RGB image, a function of `index` alone."""
    rng = np.random.default_rng(index)
    yy, xx = np.mgrid[0:H, 0:W].astype(np.float32)
    c0, c1, angle = rng.uniform(30, 220, 3), rng.uniform(30, 220, 3), rng.uniform(0, np.pi)
    t = ((xx * np.cos(angle) + yy * np.sin(angle)) / (W + H) + 0.5).clip(0, 1)[..., None]
    img = Image.fromarray((c0 * (1 - t) + c1 * t).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    for _ in range(rng.integers(8, 20)):
        x0, y0, s = rng.uniform(-0.2, 1.0) * W, rng.uniform(-0.2, 1.0) * H, rng.uniform(0.05, 0.5)
        box = [x0, y0, x0 + s * W, y0 + s * H * rng.uniform(0.5, 1.5)]
        colour = tuple(int(v) for v in rng.integers(0, 256, 3))
        kind = rng.integers(3)
        if kind == 0:
            draw.ellipse(box, fill=colour)
        elif kind == 1:
            draw.rectangle(box, fill=colour)
        else:
            draw.polygon([tuple(p) for p in rng.uniform(0, 1, (3, 2)) * (W, H)], fill=colour)
    x = np.asarray(img.filter(ImageFilter.BoxBlur(1)), dtype=np.float32)
    field = bank[rng.integers(len(bank))]
    oy, ox = rng.integers(0, H), rng.integers(0, W)
    grey = field[oy : oy + H, ox : ox + W, None]  # luminance texture
    tint = bank[(index + 1) % len(bank)][ox % H : ox % H + H, oy : oy + W, None] * rng.uniform(-0.4, 0.4, 3)
    x += rng.uniform(20, 34) * (grey + tint)  # amplitude spread gives 80-140 KB files at quality 90
    return Image.fromarray(x.clip(0, 255).astype(np.uint8))


_BANK: list[np.ndarray] = []


def _write(args: tuple[int, int, str]) -> int:
    start, stop, root = args
    if not _BANK:  # once per generating process
        _BANK.extend(_noise_bank())
    bank = _BANK
    sizes = 0
    for i in range(start, stop):
        path = Path(root) / "train" / f"class{i % CLASSES}" / f"{i:05d}.jpg"
        if not path.exists():
            buf = io.BytesIO()
            natural_image(i, bank).save(buf, "JPEG", quality=QUALITY)
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(buf.getvalue())
            tmp.rename(path)  # a killed generator leaves no truncated JPEG behind
        sizes += path.stat().st_size
    return sizes


def generate(n: int, root: Path = DATA) -> list[Path]:
    """The first n images of the folder, written if missing (in parallel, one process per core)."""
    marker = root / "generator.json"
    if marker.exists() and json.loads(marker.read_text()).get("version") != GENERATOR_VERSION:
        for f in root.glob("train/*/*.jpg"):
            f.unlink()
    for c in range(CLASSES):
        (root / "train" / f"class{c}").mkdir(parents=True, exist_ok=True)
    paths = [root / "train" / f"class{i % CLASSES}" / f"{i:05d}.jpg" for i in range(n)]
    missing = [p for p in paths if not p.exists()]
    if missing:
        from multiprocessing import Pool

        t = time.time()
        procs = max(1, min(os.cpu_count() or 1, 8))
        step = -(-n // (procs * 8))
        pool = Pool(procs)
        try:
            pool.map(_write, [(s, min(n, s + step), str(root)) for s in range(0, n, step)])
            # The workers exit on their own: `with Pool` ends with terminate(), a SIGTERM to each worker, and once
            # (a fresh-clone CI run, in the test process of `make test`) one never exited and its join hung until
            # the test's 600 s timeout.
            pool.close()
        except BaseException:
            pool.terminate()
            raise
        finally:
            pool.join()
        print(f"generated {len(missing)} JPEGs under {root} in {time.time() - t:.0f} s", flush=True)
    marker.write_text(json.dumps({"version": GENERATOR_VERSION, "size": [W, H], "quality": QUALITY}) + "\n")
    return paths


# ---------------------------------------------------------------- pipelines


def crop_params(path: Path, seed: int) -> tuple[int, int, int, int, bool]:
    """RandomResizedCrop(224)'s (i, j, h, w) for this image's size, and a flip, from a seed."""
    from torchvision.transforms import RandomResizedCrop

    with Image.open(path) as im:
        size = im.size
    torch.manual_seed(seed)
    i, j, h, w = RandomResizedCrop.get_params(Image.new("L", size), (0.08, 1.0), (3 / 4, 4 / 3))
    return i, j, h, w, bool(torch.rand(()) < 0.5)


def reference_fixed(path: Path, params, resample=None) -> torch.Tensor:
    """The reference pipeline with given crop parameters, before Normalize: float in [0, 1]."""
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as TF

    i, j, h, w, flip = params
    with open(path, "rb") as f:
        img = Image.open(f).convert("RGB")  # ImageFolder's pil_loader
    mode = resample or InterpolationMode.BILINEAR
    out = TF.resized_crop(img, i, j, h, w, [SIZE, SIZE], mode, antialias=True)
    if flip:
        out = TF.hflip(out)
    return TF.to_tensor(out)


def pil_file(path: str | Path) -> torch.Tensor:
    """PIL decode, converted to RGB as torchvision's ImageFolder loader does, as a (3, H, W) uint8 tensor."""
    from torchvision.transforms.functional import pil_to_tensor

    with open(path, "rb") as f, Image.open(f) as im:
        return pil_to_tensor(im.convert("RGB"))


def draft_scale(size: tuple[int, int], crop_h: int, crop_w: int, out: int) -> float:
    """The smallest JPEG DCT scale (1, 1/2, 1/4, 1/8) at which a (crop_h, crop_w) crop of an image of `size`
    (W, H) still has at least `out` pixels on each side: decoding smaller would throw away detail."""
    for scale in (1 / 8, 1 / 4, 1 / 2):
        if math.ceil(crop_h * scale) >= out and math.ceil(crop_w * scale) >= out:
            return scale
    return 1.0


def pil_draft_file(path: str | Path, params: tuple, out: int) -> tuple[torch.Tensor, tuple]:
    """PIL decode with `draft` at the scale `draft_scale` allows for crop `params` = (i, j, h, w, flip); returns
    the decoded tensor and the crop mapped to its size."""
    from torchvision.transforms.functional import pil_to_tensor

    i, j, h, w, flip = params
    with open(path, "rb") as f, Image.open(f) as im:
        full_w, full_h = im.size
        scale = draft_scale(im.size, h, w, out)
        if scale < 1 and im.format == "JPEG":
            im.draft("RGB", (math.ceil(full_w * scale), math.ceil(full_h * scale)))
        x = pil_to_tensor(im.convert("RGB"))
    sy, sx = x.shape[1] / full_h, x.shape[2] / full_w
    return x, (round(i * sy), round(j * sx), max(1, round(h * sy)), max(1, round(w * sx)), flip)


def decode(path: Path, how: str, params=None) -> tuple[torch.Tensor, tuple | None]:
    """A uint8 (3, H, W) tensor by one of the decoders; with `params`, those mapped to the decoded size."""
    from project.data.decode import load_image

    if how == "decode_image":  # the template's decoder
        return load_image(path), params
    if how == "pil":
        return pil_file(path), params
    if how == "pil_draft":
        return pil_draft_file(path, params, SIZE)
    raise ValueError(how)


def candidate_fixed(path: Path, params, how: str) -> torch.Tensor:
    from torchvision.transforms.v2 import functional as F2

    x, p = decode(path, how, params)
    i, j, h, w, flip = p
    out = F2.resized_crop(x, i, j, h, w, [SIZE, SIZE], antialias=True)
    if flip:
        out = F2.horizontal_flip(out)
    return out


class Files(torch.utils.data.Dataset):
    def __init__(self, paths, transform, loader):
        self.paths, self.transform, self.loader = paths, transform, loader

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, k):
        return self.transform(self.loader(self.paths[k])), k % CLASSES


def pipelines() -> dict:
    """name -> (Dataset factory over paths, batch finisher)."""
    from torchvision import transforms as T
    from torchvision.datasets.folder import pil_loader
    from torchvision.transforms import v2
    from torchvision.transforms.v2 import functional as F2

    from project.data.augment import augment_training_batch
    from project.data.decode import load_image_at
    from project.data.image_folder import ImageFiles
    from project.data.normalize import Normalize

    ref_tf = T.Compose(
        [
            T.RandomResizedCrop(SIZE),
            T.RandomHorizontalFlip(),
            T.ToTensor(),
            T.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )
    v2_tf = v2.Compose([v2.RandomResizedCrop(SIZE, antialias=True), v2.RandomHorizontalFlip()])
    pil_uint8_tf = T.Compose([T.RandomResizedCrop(SIZE), T.RandomHorizontalFlip(), T.PILToTensor()])
    norm = Normalize(IMAGENET_MEAN, IMAGENET_STD)

    def draft_loader(path):
        """Crop drawn from the header's size first, then decoded at the DCT scale that crop allows."""
        with Image.open(path) as im:  # reads the header only
            i, j, h, w = T.RandomResizedCrop.get_params(im, (0.08, 1.0), (3 / 4, 4 / 3))
        x, (i, j, h, w, _) = pil_draft_file(path, (i, j, h, w, False), SIZE)
        return F2.resized_crop(x, i, j, h, w, [SIZE, SIZE], antialias=True)

    return {
        "reference": (lambda p: Files(p, ref_tf, pil_loader), None),
        "pil_uint8": (lambda p: Files(p, v2_tf, pil_file), norm),
        # the template's default: its ImageFolder dataset and decoder (resized to the training size in the
        # worker), then its per-batch crop_flip augmentation and normalisation (project/data/base.py)
        "decode_image": (
            lambda p: ImageFiles(
                [(x, k % CLASSES) for k, x in enumerate(p)],
                functools.partial(load_image_at, size=(SIZE, SIZE)),
            ),
            lambda x: norm(augment_training_batch(x, "crop_flip", 0, 0, 0, 0)),
        ),
        "pil_draft": (lambda p: Files(p, v2.RandomHorizontalFlip(), draft_loader), norm),
        "pil_pil_uint8": (lambda p: Files(p, pil_uint8_tf, pil_loader), norm),
    }


def _time_loader(dataset, finish) -> tuple[float, float, float, int]:
    """CPU s of the loader (what a worker does), CPU s of the batch finisher (normalisation, which training runs
    on the device), wall s of both, samples."""
    loader = iter(torch.utils.data.DataLoader(dataset, batch_size=BATCH, num_workers=0, shuffle=False))
    load = fin = 0.0
    w0, n = time.perf_counter(), 0
    while True:
        c0 = time.process_time()
        batch = next(loader, None)
        c1 = time.process_time()
        load += c1 - c0
        if batch is None:
            break
        x = batch[0]
        if finish is not None:
            x = finish(x)
            fin += time.process_time() - c1
        n += len(x)
    return load, fin, time.perf_counter() - w0, n


# ---------------------------------------------------------------- breakdown


def breakdown(paths: list[Path]) -> dict:
    """ms per sample of each stage, for the reference and the chosen default (project.data.decode)."""
    from torch.utils.data import default_collate
    from torchvision import transforms as T
    from torchvision.io import decode_image
    from torchvision.transforms import v2
    from torchvision.transforms.v2 import functional as F2

    from project.data.normalize import Normalize

    blobs, stages = [], {}

    def clock(name, fn, items):
        c0 = time.process_time()
        out = [fn(x) for x in items]
        stages[name] = 1000 * (time.process_time() - c0) / len(items)
        return out

    blobs = clock("read", lambda p: open(p, "rb").read(), paths)  # noqa: SIM115 - closed by refcount
    pil = clock("decode PIL", lambda b: Image.open(io.BytesIO(b)).convert("RGB"), blobs)
    raw = clock(
        "decode decode_image",
        lambda b: decode_image(torch.frombuffer(bytearray(b), dtype=torch.uint8)),
        blobs,
    )
    rrc = T.RandomResizedCrop(SIZE)
    crops = clock("resize PIL (RandomResizedCrop)", rrc, pil)
    flipped = clock("augment PIL (flip)", T.RandomHorizontalFlip(), crops)
    floats = clock(
        "ToTensor + Normalize per sample",
        T.Compose([T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)]),
        flipped,
    )
    stages["collate float32 (per sample)"] = _per_sample(
        lambda: default_collate(floats[:BATCH]), len(floats[:BATCH])
    )
    v2rrc = v2.RandomResizedCrop(SIZE, antialias=True)
    small = clock("resize v2 uint8 (RandomResizedCrop)", v2rrc, raw)
    small = clock("augment v2 uint8 (flip)", v2.RandomHorizontalFlip(), small)
    stages["pil_to_tensor (PIL -> uint8 CHW)"] = _per_sample(
        lambda: [F2.pil_to_tensor(im) for im in pil[:BATCH]], len(pil[:BATCH])
    )
    stages["collate uint8 (per sample)"] = _per_sample(
        lambda: default_collate(small[:BATCH]), len(small[:BATCH])
    )
    batch = default_collate(small[:BATCH])
    norm = Normalize(IMAGENET_MEAN, IMAGENET_STD)
    stages["normalise once per batch, CPU (per sample)"] = _per_sample(lambda: norm(batch), len(batch))
    return {k: round(v, 3) for k, v in stages.items()}


def _per_sample(fn, n: int, repeats: int = 5) -> float:
    fn()
    c0 = time.process_time()
    for _ in range(repeats):
        fn()
    return 1000 * (time.process_time() - c0) / repeats / n


# ---------------------------------------------------------------- output check


def output_check(paths: list[Path]) -> dict:
    from torchvision.transforms import InterpolationMode

    diffs = {"bilinear_vs_bicubic (reference path)": []}
    hows = ("pil", "decode_image", "pil_draft")
    for how in hows:
        diffs[how] = []
    draft_used = 0
    for k, path in enumerate(paths):
        params = crop_params(path, seed=k)
        ref = reference_fixed(path, params)
        bicubic = reference_fixed(path, params, InterpolationMode.BICUBIC)
        diffs["bilinear_vs_bicubic (reference path)"].append((ref - bicubic).abs().mean().item())
        for how in hows:
            out = candidate_fixed(path, params, how).float() / 255
            diffs[how].append((out - ref).abs().mean().item())
        with Image.open(path) as im:
            draft_used += draft_scale(im.size, params[2], params[3], SIZE) < 1
    result = {k: round(statistics.mean(v), 5) for k, v in diffs.items()}
    result["pil_draft: crops decoded at a reduced DCT scale"] = f"{draft_used}/{len(paths)}"
    return result


# ---------------------------------------------------------------- main


def run(quick: bool, n_images: int | None = None, root: Path = DATA) -> dict:
    torch.set_num_threads(1)
    n = n_images or (500 if quick else 5000)
    paths = generate(n, root)
    sizes = sorted(p.stat().st_size / 1000 for p in paths)
    measure = paths[: min(len(paths), 256 if quick else 1024)]
    rounds = 1 if quick else 3
    pipes = pipelines()
    for make, finish in pipes.values():  # warm-up: page cache, lazy imports, allocator
        _time_loader(make(measure[:BATCH]), finish)
    cpu = {name: [] for name in pipes}
    with_norm = {name: [] for name in pipes}
    wall = {name: [] for name in pipes}
    for r in range(rounds):
        order = list(pipes) if r % 2 == 0 else list(reversed(pipes))
        for name in order:
            make, finish = pipes[name]
            load, fin, w, count = _time_loader(make(measure), finish)
            cpu[name].append(count / load)
            with_norm[name].append(count / (load + fin))
            wall[name].append(count / w)
    per_worker = {name: round(statistics.median(v), 1) for name, v in cpu.items()}
    per_worker_norm = {name: round(statistics.median(v), 1) for name, v in with_norm.items()}
    ref = per_worker["reference"]
    check = output_check(paths[: 48 if quick else 200])
    bound = check["bilinear_vs_bicubic (reference path)"]
    result = {
        "images": n,
        "file_kb": {
            "min": round(sizes[0], 1),
            "median": round(statistics.median(sizes), 1),
            "max": round(sizes[-1], 1),
        },
        "measured_images": len(measure),
        "rounds": rounds,
        "samples_per_cpu_s_per_worker": per_worker,
        "samples_per_wall_s_per_worker": {k: round(statistics.median(v), 1) for k, v in wall.items()},
        "x_reference": {k: round(v / ref, 2) for k, v in per_worker.items()},
        # the same with each batch normalised on this CPU, in this process (training on a CPU-only machine)
        "samples_per_cpu_s_with_cpu_normalisation": per_worker_norm,
        "x_reference_with_cpu_normalisation": {k: round(v / ref, 2) for k, v in per_worker_norm.items()},
        "mean_abs_diff_to_reference": check,
        "passes_output_check": {k: check[k] <= bound for k in ("pil", "decode_image", "pil_draft")},
        "breakdown_ms_per_sample": breakdown(measure[: 128 if quick else 512]),
        "default_decoder": "decode_image",
        "cpu": _cpu_model(),
        "torch_threads": torch.get_num_threads(),
    }
    return result


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="500 images, 1 round")
    parser.add_argument("--out", default=str(ROOT / "runs" / "bench" / "bench_decode.json"))
    args = parser.parse_args()
    result = run(args.quick)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

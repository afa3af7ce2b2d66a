"""`python -m project prepare`: an ImageFolder or a torchvision dataset as litdata chunks, for StreamingDataModule.

Writes `<output_dir>/{train,val,test}/` (litdata.optimize: chunk files + index.json each) and `<output_dir>/
prepare.json`, in a local directory or at an `s3://bucket/prefix` URL (credentials and endpoint from the usual
AWS variables: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL for an S3-compatible store). Each image
is resized once, here, to the training size and stored as uint8 (C, H, W), so training reads pixels and
never decodes or resizes. The splits are the image module's (project/data/datamodule.py): root/val and root/test
when present, else carved from train, stratified, by `split_seed` (test first, then val); torchvision
datasets keep their test split and carve val from train.

prepare.json holds what training, predict and export need besides the pixels (class names, the train split's
per-channel mean/std, input shape, the augmentation policy), and the settings it was written with.

Safe to re-run: a split whose index.json lists the expected number of samples is kept; a split with chunks but
no index.json (an interrupted run) is rewritten; output written with other settings, or not by this tool, is
refused unless `--overwrite true`. prepare.json is marked complete only after every split is written.

This module imports neither Lightning nor litdata at import time: the streaming data module reads prepare.json
through `read_metadata` below.
"""

import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from project.errors import ConfigError

SPLITS = ("train", "val", "test")
METADATA = "prepare.json"
FORMAT_VERSION = 1
# The settings that decide the contents: output prepared with other values is refused (or overwritten).
SETTINGS = ("source", "root", "image_size", "val_fraction", "test_fraction", "split_seed", "storage")
STATS_SAMPLES = 4096  # mean/std from at most this many evenly spaced training images (the image module: 512)

Source = Literal["imagefolder", "digits", "cifar10", "mnist", "fashionmnist"]
# The image module's augmentation per source (datamodule.py setup): shifts for digits-like data, crop + flip
# for photos, nothing for FashionMNIST.
POLICY = {
    "digits": "digits",
    "mnist": "digits",
    "fashionmnist": "none",
    "cifar10": "natural",
    "imagefolder": "natural",
}


def is_remote(path: str) -> bool:
    return "://" in path


def join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *parts]) if is_remote(base) else str(Path(base, *parts))


# ----------------------------------------------------------------------------------------------------- storage
def allow_plain_http(storage_options: dict | None = None) -> None:
    """Let litdata's obstore transfers use an http:// S3-compatible endpoint (MinIO on a LAN, moto in the tests).

    litdata (0.2.76) moves chunks with obstore, whose client refuses plain HTTP unless told, and litdata passes
    it fixed client options that ignore AWS_ALLOW_HTTP; boto3 (index files) has no such rule. So when the endpoint
    (storage_options' endpoint_url, else AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL) is http://, allow_http is
    added to those options, in this process and the loader workers it forks.
    """
    endpoint = (storage_options or {}).get("endpoint_url") or os.environ.get(
        "AWS_ENDPOINT_URL_S3", os.environ.get("AWS_ENDPOINT_URL", "")
    )
    if endpoint.startswith("http://"):
        from litdata.streaming import downloader

        downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = "true"


def _fs(url: str, storage_options: dict | None):
    from litdata.streaming.fs_provider import _get_fs_provider  # s3://, gs://, r2:// as litdata reaches them

    return _get_fs_provider(url, storage_options or {})


def _read_json(path: str, storage_options: dict | None = None) -> dict | None:
    """A JSON file's content, or None when it does not exist (local path or object-store URL)."""
    if not is_remote(path):
        return json.loads(Path(path).read_text()) if Path(path).is_file() else None
    fs = _fs(path, storage_options)
    if not fs.exists(path):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        local = os.path.join(tmp, "f.json")
        fs.download_file(path, local)
        return json.loads(Path(local).read_text())


def _write_json(path: str, content: dict, storage_options: dict | None = None) -> None:
    text = json.dumps(content, indent=2) + "\n"
    if not is_remote(path):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(path).with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(path)  # whole or not at all
        return
    with tempfile.TemporaryDirectory() as tmp:
        local = os.path.join(tmp, "f.json")
        Path(local).write_text(text)
        _fs(path, storage_options).upload_file(local, path)


def _has_files(path: str, storage_options: dict | None = None) -> bool:
    if not is_remote(path):
        return Path(path).is_dir() and any(Path(path).iterdir())
    return not _fs(path, storage_options).is_empty(path)


def _index_samples(split_dir: str, storage_options: dict | None = None) -> int | None:
    """Samples listed in a split's litdata index.json (written last by litdata.optimize), None without one."""
    index = _read_json(join(split_dir, "index.json"), storage_options)
    return None if index is None else sum(int(c["chunk_size"]) for c in index["chunks"])


def read_metadata(input_dir: str, storage_options: dict | None = None) -> dict:
    """prepare.json of a prepared dataset; a ConfigError that says what to run when it is missing or unfinished."""
    try:
        meta = _read_json(join(input_dir, METADATA), storage_options)
    except ConfigError:
        raise
    except Exception as err:  # no such bucket, no credentials, endpoint unreachable, ...
        raise ConfigError(
            f"Cannot read '{join(input_dir, METADATA)}' ({type(err).__name__}: {err}). For an object store, set "
            "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL for an S3-compatible one) or "
            "--data.init_args.storage_options."
        ) from err
    if meta is None:
        raise ConfigError(
            f"'{input_dir}' is not a prepared dataset (no {METADATA}). Write it first: python -m project prepare "
            f"--source imagefolder --root <your images> --output_dir {input_dir} --image_size <size> (or make prepare)."
        )
    if not meta.get("complete"):
        raise ConfigError(
            f"'{input_dir}' was not finished by `python -m project prepare` (interrupted?). Run the same prepare "
            "command again: it keeps the complete splits and writes the rest."
        )
    if meta.get("format_version") != FORMAT_VERSION:
        raise ConfigError(
            f"'{input_dir}' was written in format {meta.get('format_version')}, this version reads "
            f"{FORMAT_VERSION}: prepare it again with --overwrite true."
        )
    return meta


# ----------------------------------------------------------------------------------------------------- sources
class Samples:
    """A source's images as (uint8 (C, H, W) tensor at training size, label) by index; pickled to litdata's
    worker processes, so it holds only what is cheap to send (file paths, or the data root for torchvision)."""

    def __init__(self, source: str, root: str | None, size: tuple[int, int] | None, channels: int) -> None:
        self.source, self.root, self.size, self.channels = source, root, size, channels
        self.files: dict[str, list[tuple[str, int]]] = {}  # imagefolder: split -> (path, label)
        self._tensors: dict[bool, tuple[Tensor, Tensor]] = {}  # tensor sources: train? -> (images, labels)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tensors": {}}  # each worker loads its own copy

    def tensors(self, train: bool) -> tuple[Tensor, Tensor]:
        if train not in self._tensors:
            if self.source == "digits":
                from project.data import digits

                images, labels = digits.load_digits_tensors()  # float in [0, 1]: counts/16
                self._tensors[True] = self._tensors[False] = ((images * 255).round().to(torch.uint8), labels)
            else:
                from project.data import torchvision_datasets

                self._tensors[train] = torchvision_datasets.load_split(self.source, self.root, train, False)
        return self._tensors[train]

    def load(self, key: tuple[str, int]) -> tuple[Tensor, int]:
        """key = (group, index): group is an imagefolder split, or "train"/"test" of a tensor source."""
        group, i = key
        if self.source == "imagefolder":
            from PIL import Image
            from torchvision.transforms.v2.functional import pil_to_tensor

            path, label = self.files[group][i]
            with Image.open(path) as im:
                x = pil_to_tensor(im.convert("RGB"))
        else:
            images, labels = self.tensors(group == "train")
            x, label = images[i], int(labels[i])
        return self.resize(x), label

    def resize(self, x: Tensor) -> Tensor:
        """uint8 (C, H, W) at the training size: bilinear with antialiasing, as the image module resizes."""
        if self.size is None or tuple(x.shape[-2:]) == self.size:
            return x.contiguous()
        from torchvision.transforms.v2.functional import resize

        return resize(x, list(self.size), antialias=True).contiguous()


class WriteSample:
    """litdata.optimize's function: one input (group, index) -> one stored sample."""

    def __init__(self, samples: Samples) -> None:
        self.samples = samples

    def __call__(self, key: tuple[str, int]) -> dict[str, Any]:
        x, label = self.samples.load(tuple(key))
        return {"image": x, "label": label}


def _folder_samples(path: Path, class_names: list[str]) -> list[tuple[str, int]]:
    """(file, class index) of root/<split> in torchvision ImageFolder's order (the image module's order too);
    every file checked to be a readable image first, so a bad one is named here, not in a writer process."""
    from torchvision.datasets import ImageFolder

    from project.data.image_folder import LAYOUT
    from project.data.validate import check_images

    try:
        folder = ImageFolder(str(path))
    except FileNotFoundError as err:
        raise ConfigError(f"'{path}': {err}. Expected {LAYOUT}.") from err
    if folder.classes != class_names:
        raise ConfigError(
            f"'{path}' has classes {folder.classes}, but '{path.parent / 'train'}' has {class_names}. "
            "Every split must have the same class folders."
        )
    check_images(folder.samples, path)
    return list(folder.samples)


def _stratified(
    labels: list[int] | Tensor, fraction: float, seed: int, name: str
) -> tuple[list[int], list[int]]:
    from project.data.tensor_dataset import stratified_split

    if fraction <= 0:
        raise ConfigError(
            f"There is no {name} split and --{name}_fraction is 0: add root/{name}/ or pass a fraction such as 0.1."
        )
    try:
        return stratified_split(labels, fraction, seed)
    except ValueError as err:
        raise ConfigError(
            f"Cannot hold out a stratified {name} split (--{name}_fraction {fraction}) from {len(labels)} "
            f"samples: {err} Change --{name}_fraction, or add data."
        ) from err


def plan(
    source: str,
    root: str | None,
    image_size: int | None,
    val_fraction: float,
    test_fraction: float,
    split_seed: int,
) -> tuple[Samples, dict[str, list[tuple[str, int]]], list[int], list[str], tuple[int, int, int]]:
    """(samples, split -> keys, train labels, class names, (C, H, W)): the same splits as the image module."""
    size = (image_size, image_size) if image_size else None
    if source == "imagefolder":
        from project.data import image_folder

        if root is None:
            raise ConfigError("--source imagefolder needs --root: the folder with train/<class>/ inside.")
        class_names, native = image_folder.describe(root)
        samples = Samples(source, root, size or native, 3)
        keys: dict[str, list[tuple[str, int]]] = {}
        for name in SPLITS:
            if (Path(root) / name).is_dir():
                samples.files[name] = _folder_samples(Path(root) / name, class_names)
        train = samples.files["train"]
        labels = [label for _, label in train]
        index = list(range(len(train)))
        carved: dict[str, list[int]] = {}
        # test first, then val, as the image module carves them
        for name, fraction in (("test", test_fraction), ("val", val_fraction)):
            if name not in samples.files:
                keep, held = _stratified([labels[i] for i in index], fraction, split_seed, name)
                index, carved[name] = [index[i] for i in keep], [index[i] for i in held]
        keys["train"] = [("train", i) for i in index]
        for name in ("val", "test"):
            keys[name] = (
                [("train", i) for i in carved[name]]
                if name in carved
                else [(name, i) for i in range(len(samples.files[name]))]
            )
        train_labels = [labels[i] for i in index]
        return samples, keys, train_labels, class_names, (3, *(size or native))
    if source == "digits":
        from project.data import digits

        c, h, w = digits.INPUT_SHAPE
        samples = Samples(source, None, size, c)
        _, labels = samples.tensors(True)
        rest, test = _stratified(labels, test_fraction, split_seed, "test")
        keep, val = _stratified(labels[rest], val_fraction, split_seed, "val")
        train_idx, val_idx = [rest[i] for i in keep], [rest[i] for i in val]
        keys = {"train": [("train", i) for i in train_idx], "val": [("train", i) for i in val_idx]}
        keys["test"] = [("test", i) for i in test]
        return samples, keys, labels[train_idx].tolist(), list(digits.CLASSES), (c, *(size or (h, w)))
    from project.data import torchvision_datasets

    if source not in torchvision_datasets.DATASETS:
        raise ConfigError(
            f"--source {source}: expected imagefolder, digits, {', '.join(torchvision_datasets.DATASETS)}."
        )
    if root is None:
        raise ConfigError(f"--source {source} needs --root: the folder torchvision keeps its files in.")
    from project.data.validate import check_labels

    c, h, w = torchvision_datasets.DATASETS[source][1]
    samples = Samples(source, root, size, c)
    _, labels = samples.tensors(True)
    _, test_labels = samples.tensors(False)
    n_classes = len(torchvision_datasets.classes_of(source))
    check_labels(labels, n_classes, f"The {source} training data")  # StreamingDataModule.labels_checked
    check_labels(test_labels, n_classes, f"The {source} test data")
    keep, val = _stratified(labels, val_fraction, split_seed, "val")
    keys = {"train": [("train", i) for i in keep], "val": [("train", i) for i in val]}
    keys["test"] = [("test", i) for i in range(len(test_labels))]
    class_names = torchvision_datasets.classes_of(source)
    return samples, keys, labels[keep].tolist(), class_names, (c, *(size or (h, w)))


def channel_stats(samples: Samples, keys: list[tuple[str, int]]) -> tuple[list[float], list[float]]:
    """Per-channel mean/std on the [0, 1] scale of up to STATS_SAMPLES evenly spaced training images."""
    from project.data.transforms import channel_stats as stats

    step = max(1, math.ceil(len(keys) / STATS_SAMPLES))
    return stats(torch.stack([samples.load(k)[0] for k in keys[::step]]))


# ----------------------------------------------------------------------------------------------------- prepare
def prepare(
    source: Source,
    output_dir: str,
    root: str | None = None,
    image_size: int | None = None,
    val_fraction: float = 0.1,
    test_fraction: float = 0.2,
    split_seed: int = 0,
    num_workers: int | None = None,
    chunk_bytes: str = "64MB",
    overwrite: bool = False,
) -> dict:
    """Write a dataset as litdata chunks (train/val/test), resized to the training size, for StreamingDataModule.

    Args:
        source: imagefolder (root/train/<class>/*, root/val and root/test optional), digits (the embedded
            data), or a torchvision dataset read from its usual files under root: cifar10, mnist, fashionmnist.
        output_dir: a local directory or an object-store URL (s3://bucket/prefix).
        root: the data directory (every source but digits).
        image_size: resize every image to image_size x image_size once, here; unset keeps the native size
            (ImageFolder: the first training image's size, as the image module).
        val_fraction: share of the non-test training data held out for validation when there is no val split.
        test_fraction: share of all data held out for test when there is no test split.
        split_seed: seed of the stratified splits (the image module's data.split_seed).
        num_workers: writer processes; unset = the CPUs this process may use.
        chunk_bytes: target size of one chunk file (litdata), e.g. 64MB.
        overwrite: replace output written with other settings or by something else.

    Returns prepare.json's content.
    """
    # litdata asks PyPI for a newer version at each optimize() otherwise
    os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")
    for name, fraction in (("val", val_fraction), ("test", test_fraction)):
        if not 0 <= fraction < 1:
            raise ConfigError(f"--{name}_fraction {fraction} is outside [0, 1): pass a share such as 0.1.")
    if image_size is not None and image_size < 1:
        raise ConfigError(f"--image_size {image_size}: pass a size in pixels, such as 64, or leave it unset.")
    if not is_remote(output_dir):
        output_dir = str(Path(output_dir).resolve())
    settings = {
        "source": source,
        "root": str(Path(root).resolve()) if root else None,
        "image_size": image_size,
        "val_fraction": val_fraction,
        "test_fraction": test_fraction,
        "split_seed": split_seed,
        "storage": "uint8",
    }
    meta_path = join(output_dir, METADATA)
    old = _read_json(meta_path)
    if old is not None and any(old.get(k) != settings[k] for k in SETTINGS) and not overwrite:
        diff = ", ".join(f"{k}: {old.get(k)} -> {settings[k]}" for k in SETTINGS if old.get(k) != settings[k])
        raise ConfigError(
            f"'{output_dir}' holds a dataset prepared with other settings ({diff}). Choose another --output_dir, "
            "or pass --overwrite true to replace it."
        )
    if old is None and not overwrite:
        foreign = [s for s in SPLITS if _has_files(join(output_dir, s))]
        if foreign:
            raise ConfigError(
                f"'{output_dir}' already has {', '.join(foreign)} but no {METADATA}: it was not written by "
                "`python -m project prepare`. Choose another --output_dir, or pass --overwrite true to replace it."
            )
    if old is not None and old.get("complete") and not overwrite:
        if all(_index_samples(join(output_dir, s)) == old["splits"].get(s) for s in SPLITS):
            print(
                f"{output_dir}: already prepared ({_counts(old['splits'])}); nothing to do.", file=sys.stderr
            )
            return old

    samples, keys, train_labels, class_names, input_shape = plan(
        source, root, image_size, val_fraction, test_fraction, split_seed
    )
    counts = {s: len(keys[s]) for s in SPLITS}
    for s in SPLITS:
        if not counts[s]:
            raise ConfigError(
                f"The {s} split is empty. Add images under root/{s}/, or change --{s}_fraction."
            )
    meta = {
        "format_version": FORMAT_VERSION,
        **settings,
        "complete": False,
        "splits": counts,
        "class_names": class_names,
        "input_shape": list(input_shape),
        "augment_policy": POLICY[source],
    }
    _write_json(meta_path, meta)  # the settings first: a re-run after an interruption compares against them

    import litdata

    workers = num_workers or max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
    staging: dict[str, str] = {}
    if is_remote(output_dir):
        allow_plain_http()
        # litdata stages chunks for upload under $TMPDIR/chunks and empties that folder when it starts: two
        # prepares at once (or a test suite's workers) would delete each other's chunks. A folder of our own.
        private = tempfile.mkdtemp(prefix="prepare-")
        staging = {
            var: os.environ.get(var) or os.path.join(private, sub)
            for var, sub in (
                ("DATA_OPTIMIZER_CACHE_FOLDER", "chunks"),
                ("DATA_OPTIMIZER_DATA_CACHE_FOLDER", "data"),
            )
        }
    saved = {var: os.environ.get(var) for var in staging}
    os.environ.update(staging)
    try:
        for split in SPLITS:
            split_dir = join(output_dir, split)
            have = None if overwrite else _index_samples(split_dir)
            if have == counts[split]:
                print(f"{split}: complete ({have} samples), kept.", file=sys.stderr)
                continue
            mode = None
            if _has_files(split_dir):
                why = (
                    "--overwrite true"
                    if overwrite
                    else (
                        f"its index lists {have} samples, not {counts[split]}"
                        if have is not None
                        else "chunks without index.json: an interrupted run"
                    )
                )
                print(f"{split}: replacing the existing output ({why}).", file=sys.stderr)
                mode = "overwrite"
            print(f"{split}: writing {counts[split]} samples to {split_dir}", file=sys.stderr)
            litdata.optimize(
                fn=WriteSample(samples),
                inputs=keys[split],
                output_dir=split_dir,
                chunk_bytes=chunk_bytes,
                num_workers=min(workers, len(keys[split])),
                mode=mode,
                keep_data_ordered=True,  # the same chunks for the same settings, run after run
                reorder_files=False,
                start_method="fork",  # workers inherit the imports: spawn re-imported torch in each (~90 s on 2 busy cores)
                verbose=True,  # litdata's progress bar
            )
            have = _index_samples(split_dir)
            if have != counts[split]:
                raise RuntimeError(f"{split_dir}: litdata wrote {have} samples, expected {counts[split]}.")

    finally:
        for var, value in saved.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
        if staging:
            shutil.rmtree(private, ignore_errors=True)
    mean, std = channel_stats(samples, keys["train"])
    meta.update(complete=True, mean=mean, std=std)
    _write_json(meta_path, meta)
    print(f"{output_dir}: prepared ({_counts(counts)}), input shape {tuple(input_shape)}.", file=sys.stderr)
    return meta


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{s} {counts[s]}" for s in SPLITS)


def main(args: list[str]) -> None:
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(prog="python -m project prepare", description=prepare.__doc__.splitlines()[0])
    parser.add_function_arguments(prepare, as_group=False)
    cfg = parser.parse_args(args)
    prepare(**cfg.as_dict())

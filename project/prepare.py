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

The format itself (prepare.json, the splits' index files, object-store access) is project/data/chunks.py's, which
the streaming data module reads through; this module is the command on top of it. It imports neither Lightning
nor litdata at import time.
"""

import math
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from project.data.chunks import (
    FORMAT_VERSION,
    METADATA,
    MIN_CHUNKS,
    SPLITS,
    allow_plain_http,
    has_files,
    index_samples,
    is_remote,
    join,
    read_json,
    write_json,
)
from project.errors import ConfigError

# The settings that decide the contents: output prepared with other values is refused (or overwritten).
SETTINGS = ("source", "root", "image_size", "val_fraction", "test_fraction", "split_seed", "storage")

Source = Literal["imagefolder", "digits", "cifar10", "mnist", "fashionmnist"]


# ----------------------------------------------------------------------------------------------------- sources
class Samples:
    """A source's images by key (split group, index), as the image module serves them: `pixels` at the training
    size (project/data/normalize.py's `resize`; uint8, float in [0, 1] for digits) and `load`, what is stored (uint8).
    Pickled to litdata's worker processes, so it holds only what is cheap to send (file paths, or the data root)."""

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

                self._tensors[True] = self._tensors[False] = digits.load_digits_tensors()  # float in [0, 1]
            else:
                from project.data import torchvision_datasets

                self._tensors[train] = torchvision_datasets.load_split(self.source, self.root, train, False)
        return self._tensors[train]

    def pixels(self, key: tuple[str, int]) -> Tensor:
        """key = (group, index): group is an imagefolder split, or "train"/"test" of a tensor source."""
        from project.data.normalize import resize

        group, i = key
        if self.source == "imagefolder":
            from project.data.decode import load_image_at

            return load_image_at(self.files[group][i][0], self.size)
        return resize(self.tensors(group == "train")[0][i], self.size)

    def label(self, key: tuple[str, int]) -> int:
        group, i = key
        if self.source == "imagefolder":
            return self.files[group][i][1]
        return int(self.tensors(group == "train")[1][i])

    def load(self, key: tuple[str, int]) -> tuple[Tensor, int]:
        """The stored sample: uint8 (C, H, W) pixels (float sources rounded to 8 bits) and the label."""
        x = self.pixels(key)
        if x.dtype != torch.uint8:
            x = (x * 255).round_().to(torch.uint8)
        return x.contiguous(), self.label(key)


class WriteSample:
    """litdata.optimize's function: one input (group, index) -> one stored sample."""

    def __init__(self, samples: Samples) -> None:
        self.samples = samples

    def __call__(self, key: tuple[str, int]) -> dict[str, Any]:
        x, label = self.samples.load(tuple(key))
        return {"image": x, "label": label}


def _flag(name: str) -> str:
    return f"--{name}_fraction"


def plan(
    source: str,
    root: str | None,
    image_size: int | None,
    val_fraction: float,
    test_fraction: float,
    split_seed: int,
) -> tuple[Samples, dict[str, list[tuple[str, int]]], list[str], tuple[int, int, int]]:
    """(samples, split -> keys, class names, (C, H, W)): the image module's splits of the same data, by the same
    function (project/data/splits.py) over the same sample list."""
    from project.data.splits import carve

    size = (image_size, image_size) if image_size else None
    wanted = {"test": test_fraction, "val": val_fraction}
    if source == "imagefolder":
        from project.data import folder_index, image_folder
        from project.data.validate import fail_unreadable

        if root is None:
            raise ConfigError("--source imagefolder needs --root: the folder with train/<class>/ inside.")
        class_names, native = image_folder.describe(root)
        samples = Samples(source, root, size or native, 3)
        index = folder_index.index_folder(root, class_names)  # the image module's listing, order and checks
        for name, files in index.samples.items():  # a bad file is named here, not in a writer process
            fail_unreadable(index.unreadable[name], len(files), Path(root) / name)
        samples.files = index.samples
        given = {name for name in ("val", "test") if name in index.samples}
        train = index.samples["train"]
        fractions = {name: f for name, f in wanted.items() if name not in given}
        parts = carve([y for _, y in train], len(train), fractions, split_seed, _flag)
        keys = {name: [("train", i) for i in idx] for name, idx in parts.items()}
        keys.update({name: [(name, i) for i in range(len(index.samples[name]))] for name in given})
        return samples, keys, class_names, (3, *(size or native))
    if source == "digits":
        from project.data import digits

        c, h, w = digits.INPUT_SHAPE
        samples = Samples(source, None, size, c)
        _, labels = samples.tensors(True)
        parts = carve(labels, len(labels), wanted, split_seed, _flag)
        keys = {name: [("train", i) for i in idx] for name, idx in parts.items()}
        return samples, keys, list(digits.CLASSES), (c, *(size or (h, w)))
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
    class_names = torchvision_datasets.classes_of(source)
    check_labels(
        labels, len(class_names), f"The {source} training data"
    )  # StreamingDataModule.labels_checked
    check_labels(test_labels, len(class_names), f"The {source} test data")
    parts = carve(labels, len(labels), {"val": val_fraction}, split_seed, _flag)
    keys = {name: [("train", i) for i in idx] for name, idx in parts.items()}
    keys["test"] = [("test", i) for i in range(len(test_labels))]
    return samples, keys, class_names, (c, *(size or (h, w)))


def channel_stats(samples: Samples, keys: list[tuple[str, int]]) -> tuple[list[float], list[float]]:
    """The training split's normalisation statistics by the image module's rule (project/data/stats.py), from
    the pixels before they are stored as 8 bits."""
    from project.data.stats import train_stats

    return train_stats(samples.pixels, keys)


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
    min_chunks: int = MIN_CHUNKS,
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
        chunk_bytes: largest size of one chunk file (litdata), e.g. 64MB.
        min_chunks: write each split as at least this many chunk files (smaller ones when the split is small):
            litdata shuffles and shards the training split chunk by chunk (project/data/chunks.py, MIN_CHUNKS).
        overwrite: replace output written with other settings or by something else.

    Returns prepare.json's content.
    """
    # litdata asks PyPI for a newer version at each optimize() otherwise
    os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")
    for name, fraction in (("val", val_fraction), ("test", test_fraction)):
        if not 0 <= fraction < 1:
            raise ConfigError(f"--{name}_fraction {fraction} is outside [0, 1): pass a share such as 0.1.")
    if min_chunks < 1:
        raise ConfigError(f"--min_chunks {min_chunks}: pass 1 or more, such as the default {MIN_CHUNKS}.")
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
    old = read_json(meta_path)
    if old is not None and any(old.get(k) != settings[k] for k in SETTINGS) and not overwrite:
        diff = ", ".join(f"{k}: {old.get(k)} -> {settings[k]}" for k in SETTINGS if old.get(k) != settings[k])
        raise ConfigError(
            f"'{output_dir}' holds a dataset prepared with other settings ({diff}). Choose another --output_dir, "
            "or pass --overwrite true to replace it."
        )
    if old is None and not overwrite:
        foreign = [s for s in SPLITS if has_files(join(output_dir, s))]
        if foreign:
            raise ConfigError(
                f"'{output_dir}' already has {', '.join(foreign)} but no {METADATA}: it was not written by "
                "`python -m project prepare`. Choose another --output_dir, or pass --overwrite true to replace it."
            )
    if old is not None and old.get("complete") and not overwrite:
        if all(index_samples(join(output_dir, s)) == old["splits"].get(s) for s in SPLITS):
            print(
                f"{output_dir}: already prepared ({_counts(old['splits'])}); nothing to do.", file=sys.stderr
            )
            return old

    samples, keys, class_names, input_shape = plan(
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
    }
    write_json(meta_path, meta)  # the settings first: a re-run after an interruption compares against them

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
            have = None if overwrite else index_samples(split_dir)
            if have == counts[split]:
                print(f"{split}: complete ({have} samples), kept.", file=sys.stderr)
                continue
            mode = None
            if has_files(split_dir):
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
                chunk_size=samples_per_chunk(len(keys[split]), input_shape, chunk_bytes, min_chunks),
                num_workers=min(workers, len(keys[split])),
                mode=mode,
                keep_data_ordered=True,  # the same chunks for the same settings, run after run
                reorder_files=False,
                start_method="fork",  # workers inherit the imports: spawn re-imported torch in each, for every split
                verbose=True,  # litdata's progress bar
            )
            have = index_samples(split_dir)
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
    write_json(meta_path, meta)
    print(f"{output_dir}: prepared ({_counts(counts)}), input shape {tuple(input_shape)}.", file=sys.stderr)
    return meta


def samples_per_chunk(samples: int, input_shape: tuple[int, ...], chunk_bytes: str, min_chunks: int) -> int:
    """Samples per chunk file: at most `chunk_bytes` of them, and few enough for `min_chunks` chunks per split.
    Every stored sample has the same size (uint8 (C, H, W) and a label)."""
    from litdata.utilities.format import _convert_bytes_to_int

    sample_bytes = math.prod(input_shape) + 64  # pixels + label, offset and serialisation overhead
    by_size = max(1, _convert_bytes_to_int(chunk_bytes) // sample_bytes)
    return max(1, min(by_size, samples // min_chunks))  # rounded down: at least min_chunks chunks


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{s} {counts[s]}" for s in SPLITS)


def main(args: list[str]) -> None:
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(prog="python -m project prepare", description=prepare.__doc__.splitlines()[0])
    parser.add_function_arguments(prepare, as_group=False)
    cfg = parser.parse_args(args)
    prepare(**cfg.as_dict())

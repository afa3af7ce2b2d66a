"""`python -m project prepare`: a data source as litdata chunks for StreamingDataModule, in a local directory or
at an s3:// URL. The splits, pixels and statistics are the image module's: its datasets are what `litdata.optimize`
writes, each image once at the training size as uint8; prepare.json (chunks.py) holds the rest.
"""

import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Literal
from unittest import mock

import torch
from jsonargparse.typing import PositiveInt

from project.data import chunks
from project.data.chunks import SPLITS, index_samples, is_remote, join
from project.errors import ConfigError

# The settings that decide the contents: output prepared with other values is refused (or overwritten).
SETTINGS = ("source", "root", "image_size", "val_fraction", "test_fraction", "split_seed", "storage")


class StoredSample:
    """litdata.optimize's function: sample i of a split as stored, uint8 pixels and label."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __call__(self, i: int) -> dict:
        x, label = self.dataset[i]
        if x.dtype != torch.uint8:
            x = (x * 255).round_().to(torch.uint8)
        return {"image": x.contiguous(), "label": int(label)}


def prepare(
    source: Literal["imagefolder", "digits", "cifar10", "mnist", "fashionmnist"],
    output_dir: str,
    root: str | None = None,
    image_size: PositiveInt | None = None,
    val_fraction: float = 0.1,
    test_fraction: float = 0.2,
    split_seed: int = 0,
    num_workers: int | None = None,
    chunk_bytes: str = "64MB",
    min_chunks: PositiveInt = chunks.MIN_CHUNKS,
    overwrite: bool = False,
) -> dict:
    """Write a dataset as litdata chunks (train/val/test), resized to the training size, for StreamingDataModule.

    Args:
        source: imagefolder (root/train/<class>/*, root/val and root/test optional), digits (the embedded
            data), or a torchvision dataset read from its usual files under root: cifar10, mnist, fashionmnist.
        output_dir: a local directory or an object-store URL (s3://bucket/prefix).
        root: the data directory (every source but digits).
        image_size: resize every image to image_size x image_size once, here; unset keeps the native size.
        val_fraction: share of the non-test training data held out for validation when there is no val split.
        test_fraction: share of all data held out for test when there is no test split.
        split_seed: seed of the stratified splits (the image module's data.split_seed).
        num_workers: writer processes; unset: the CPUs this process may use.
        chunk_bytes: largest size of one chunk file (litdata), e.g. 64MB.
        min_chunks: write each split as at least this many chunk files: litdata shuffles and shards by chunk.
        overwrite: replace output written with other settings or by something else.
    """
    os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")  # else litdata asks PyPI at each optimize()
    output_dir = output_dir if is_remote(output_dir) else str(Path(output_dir).resolve())
    root = str(Path(root).resolve()) if root else None
    settings = dict(source=source, root=root, image_size=image_size, val_fraction=val_fraction)
    settings.update(test_fraction=test_fraction, split_seed=split_seed, storage="uint8")
    old = chunks.read_json(meta_path := join(output_dir, chunks.METADATA))
    if old is None and not overwrite and any(chunks.has_files(join(output_dir, s)) for s in SPLITS):
        raise ConfigError(
            f"'{output_dir}' already has splits but no {chunks.METADATA}: it was not written by `python -m project "
            "prepare`. Choose another --output_dir, or pass --overwrite true to replace it."
        )
    changed = [f"{k}: {old.get(k)} -> {settings[k]}" for k in SETTINGS if old and old.get(k) != settings[k]]
    if changed and not overwrite:
        raise ConfigError(
            f"'{output_dir}' holds a dataset prepared with other settings ({', '.join(changed)}). Choose another "
            "--output_dir, or pass --overwrite true to replace it."
        )
    if old and old.get("complete") and not overwrite:
        if all(index_samples(join(output_dir, s)) == old["splits"][s] for s in SPLITS):
            print(f"{output_dir}: already prepared ({old['splits']}); nothing to do.", file=sys.stderr)
            return old

    from project.data.datamodule import ImageClassificationDataModule

    fractions = dict(val_fraction=val_fraction, test_fraction=test_fraction, split_seed=split_seed)
    try:  # the splits, the checks (root, fractions), the training split's statistics at the training size
        image = ImageClassificationDataModule(source, root, batch_size=1, image_size=image_size, **fractions)
        image.setup()
    except ConfigError as err:  # named by prepare's flags, not the image module's
        raise ConfigError(str(err).replace("--data.init_args.", "--")) from err
    datasets = {"train": image.train_set, "val": image.val_set, "test": image.test_set}
    counts = {s: len(datasets[s]) for s in SPLITS}
    meta = dict(**settings, complete=False, splits=counts, class_names=image.class_names)
    meta.update(input_shape=list(image.input_shape), fingerprint=image.split_fingerprint)
    # the settings first: a re-run after an interruption compares against them
    chunks.write_json(meta_path, meta)
    if is_remote(output_dir):
        chunks.allow_plain_http()

    import litdata
    from litdata.utilities.format import _convert_bytes_to_int

    workers = num_workers or len(os.sched_getaffinity(0))
    # litdata stages chunks for upload under $TMPDIR/chunks and empties that folder when it starts: two prepares
    # at once would delete each other's chunks. A folder of our own.
    staging = tempfile.TemporaryDirectory(prefix="prepare-")
    folders = ("DATA_OPTIMIZER_CACHE_FOLDER", "DATA_OPTIMIZER_DATA_CACHE_FOLDER")
    private = {v: os.environ.get(v, f"{staging.name}/{v}") for v in folders} if is_remote(output_dir) else {}
    with staging, mock.patch.dict(os.environ, private):
        for split in SPLITS:
            split_dir, n = join(output_dir, split), counts[split]
            if not overwrite and index_samples(split_dir) == n:
                print(f"{split}: complete ({n} samples), kept.", file=sys.stderr)
                continue
            print(f"{split}: writing {n} samples to {split_dir}", file=sys.stderr)
            # at most chunk_bytes per chunk, and at least min_chunks chunks (every sample has the same size)
            by_size = _convert_bytes_to_int(chunk_bytes) // (math.prod(image.input_shape) + 64)
            litdata.optimize(
                fn=StoredSample(datasets[split]),
                inputs=list(range(n)),
                output_dir=split_dir,
                chunk_size=max(1, min(by_size, n // min_chunks)),
                num_workers=min(workers, n),
                mode="overwrite",  # an interrupted run's chunks (no index.json, which litdata writes last)
                keep_data_ordered=True,  # the same chunks for the same settings, run after run
                reorder_files=False,
                start_method="fork",  # the workers inherit the datasets: spawn would pickle and re-import them
            )
    meta.update(complete=True, mean=image.mean, std=image.std)
    chunks.write_json(meta_path, meta)
    print(f"{output_dir}: prepared ({counts}), input shape {tuple(image.input_shape)}.", file=sys.stderr)
    return meta


def main(args: list[str]) -> None:
    from jsonargparse import auto_cli

    auto_cli(prepare, args=args, prog="python -m project prepare", as_positional=False)

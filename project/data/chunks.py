"""The on-disk format of a prepared dataset: litdata chunks per split plus `prepare.json`, local or in object storage.

`python -m project prepare` writes it and StreamingDataModule reads it; both go through this module, which knows
the layout (`<dir>/prepare.json`, `<dir>/<split>/index.json` and its chunk files), the object-store access
litdata uses, and how to check a split cheaply before a run starts (`check_split`). It imports neither Lightning
nor litdata at import time.

A litdata chunk file (litdata 0.2.76, uncompressed) starts with its sample count n (uint32) and n + 1 uint32
offsets: the first is the header's length (4 + 4 (n + 1)), the last the file's length. index.json lists each
chunk's `filename`, `chunk_size` (n) and `chunk_bytes` (the file's length).
"""

import json
import os
import tempfile
from pathlib import Path

import numpy as np

from project.atomic import write_text_atomic
from project.errors import ConfigError

SPLITS = ("train", "val", "test")
METADATA = "prepare.json"
FORMAT_VERSION = 1
# The chunk files prepare writes per split, at least. litdata (0.2.76) shuffles a training split chunk by chunk:
# each epoch permutes the chunk list with (seed, epoch) and deals it out in order, a contiguous run of chunks to
# each rank and loader worker, and drop_last leaves out the tail of the last chunk dealt. With the 2 chunks one 64MB target gave the digits, each of 2 DDP ranks read
# one of the same two halves every epoch. With 32, a rank's share is a new mix of chunks each epoch, the samples
# left out come from another chunk than the epoch before's with probability 31/32, and up to 8 ranks x 4 loader
# workers still get whole chunks of their own. A chunk file more costs a file open (one GET from a store).
MIN_CHUNKS = 32


def is_remote(path: str) -> bool:
    return "://" in path


def join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *parts]) if is_remote(base) else str(Path(base, *parts))


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


def object_store(url: str, storage_options: dict | None):
    """litdata's file system for an object-store URL (s3://, gs://, r2://), as its loaders reach it."""
    from litdata.streaming.fs_provider import _get_fs_provider

    return _get_fs_provider(url, storage_options or {})


def read_json(path: str, storage_options: dict | None = None) -> dict | None:
    """A JSON file's content, or None when it does not exist (local path or object-store URL)."""
    if not is_remote(path):
        return json.loads(Path(path).read_text()) if Path(path).is_file() else None
    fs = object_store(path, storage_options)
    if not fs.exists(path):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        local = os.path.join(tmp, "f.json")
        fs.download_file(path, local)
        return json.loads(Path(local).read_text())


def write_json(path: str, content: dict, storage_options: dict | None = None) -> None:
    text = json.dumps(content, indent=2) + "\n"
    if not is_remote(path):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, text)  # whole or not at all
        return
    with tempfile.TemporaryDirectory() as tmp:
        local = os.path.join(tmp, "f.json")
        Path(local).write_text(text)
        object_store(path, storage_options).upload_file(local, path)


def has_files(path: str, storage_options: dict | None = None) -> bool:
    if not is_remote(path):
        return Path(path).is_dir() and any(Path(path).iterdir())
    return not object_store(path, storage_options).is_empty(path)


def index_samples(split_dir: str, storage_options: dict | None = None) -> int | None:
    """Samples listed in a split's litdata index.json (written last by litdata.optimize), None without one."""
    index = read_json(join(split_dir, "index.json"), storage_options)
    return None if index is None else sum(int(c["chunk_size"]) for c in index["chunks"])


def read_metadata(input_dir: str, storage_options: dict | None = None) -> dict:
    """prepare.json of a prepared dataset; a ConfigError that says what to run when it is missing or unfinished."""
    try:
        meta = read_json(join(input_dir, METADATA), storage_options)
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


def rewrite_hint(meta: dict, input_dir: str) -> str:
    """The prepare command that writes `input_dir` again with the settings it was written with."""
    parts = [f"python -m project prepare --source {meta.get('source', '<source>')}"]
    if meta.get("root"):
        parts.append(f"--root {meta['root']}")
    parts.append(f"--output_dir {input_dir}")
    if meta.get("image_size"):
        parts.append(f"--image_size {meta['image_size']}")
    return " ".join(parts) + " --overwrite true"


def check_split(input_dir: str, split: str, meta: dict, storage_options: dict | None = None) -> int:
    """Check a split before a run reads it; returns its chunk count. A ConfigError names the file and the fix.

    Remote: its index.json is there, readable and lists prepare.json's sample count (the chunks are fetched
    later, one at a time). Local: also every chunk file listed, with the size the index gives it and a header
    that agrees with it (sample count, first and last offset): a few bytes per chunk, no sample read.
    """
    split_dir = join(input_dir, split)
    index_path = join(split_dir, "index.json")
    fix = f"Write the dataset again: {rewrite_hint(meta, input_dir)}"
    try:
        index = read_json(index_path, storage_options)
    except (ValueError, UnicodeDecodeError) as err:
        raise ConfigError(f"'{index_path}' is not a litdata index ({err}). {fix}") from err
    if index is None:
        raise ConfigError(f"'{index_path}' is missing: the {split} split cannot be read. {fix}")
    try:
        chunks = list(index["chunks"])
        listed = sum(int(c["chunk_size"]) for c in chunks)
        compressed = (index.get("config") or {}).get("compression")
    except (KeyError, TypeError, ValueError) as err:
        raise ConfigError(f"'{index_path}' is not a litdata index (no {err}). {fix}") from err
    expected = meta["splits"][split]
    if listed != expected:
        raise ConfigError(
            f"'{index_path}' lists {listed} samples, but {METADATA} says the {split} split has {expected}. {fix}"
        )
    if is_remote(input_dir):
        return len(chunks)
    for chunk in chunks:
        path = Path(split_dir, chunk["filename"])
        size, n = int(chunk["chunk_bytes"]), int(chunk["chunk_size"])
        if not path.is_file():
            raise ConfigError(f"'{path}' is missing (listed in '{index_path}'). {fix}")
        actual = path.stat().st_size
        if actual != size:
            raise ConfigError(
                f"'{path}' holds {actual} bytes, but '{index_path}' says {size} (truncated or replaced?). {fix}"
            )
        if compressed:
            continue  # the header is inside the compressed stream
        header = 4 * (n + 2)
        with open(path, "rb") as f:
            head = (
                np.frombuffer(f.read(header), dtype=np.uint32) if size >= header else np.zeros(0, np.uint32)
            )
        if (
            len(head) < n + 2
            or head[0] != n
            or head[1] != header
            or head[-1] != size
            or np.any(np.diff(head[1:]) < 0)
        ):
            raise ConfigError(
                f"'{path}' has a damaged header: it does not describe the {n} samples and {size} bytes that "
                f"'{index_path}' lists (overwritten?). {fix}"
            )
    return len(chunks)

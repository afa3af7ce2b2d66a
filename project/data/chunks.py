"""The format of a prepared dataset, which prepare writes and StreamingDataModule reads: `<dir>/prepare.json` and
litdata chunks per split (`<dir>/<split>/index.json` and its chunk files), locally or in object storage.

A litdata 0.2.76 chunk file starts with its sample count n (uint32) and n + 1 uint32 offsets: the first is the
header's length, the last the file's; index.json lists each chunk's `filename`, `chunk_size` (n) and `chunk_bytes`.
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
# prepare's default chunk count: litdata shuffles and shards chunk by chunk, so with few chunks a rank reads nearly
# the same share every epoch; 32 give new shares and whole chunks to 8 ranks x 4 workers.
MIN_CHUNKS = 32


def is_remote(path: str) -> bool:
    return "://" in path


def join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *parts]) if is_remote(base) else str(Path(base, *parts))


def allow_plain_http(storage_options: dict | None = None) -> None:
    """Let litdata's obstore client reach an http:// endpoint (MinIO, moto): litdata passes it fixed client
    options, so AWS_ALLOW_HTTP has no effect."""
    env = os.environ.get("AWS_ENDPOINT_URL_S3", os.environ.get("AWS_ENDPOINT_URL", ""))
    if ((storage_options or {}).get("endpoint_url") or env).startswith("http://"):
        from litdata.streaming import downloader

        downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = "true"


def _store(url: str, storage_options: dict | None):
    from litdata.streaming.fs_provider import _get_fs_provider

    return _get_fs_provider(url, storage_options or {})


def read_json(path: str, storage_options: dict | None = None) -> dict | None:
    """A JSON file's content, None when it does not exist."""
    if not is_remote(path):
        return json.loads(Path(path).read_text()) if Path(path).is_file() else None
    if not (store := _store(path, storage_options)).exists(path):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        store.download_file(path, f"{tmp}/f.json")
        return json.loads(Path(tmp, "f.json").read_text())


def write_json(path: str, content: dict, storage_options: dict | None = None) -> None:
    text = json.dumps(content, indent=2) + "\n"
    if not is_remote(path):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        return write_text_atomic(path, text)
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "f.json").write_text(text)
        _store(path, storage_options).upload_file(f"{tmp}/f.json", path)


def has_files(path: str, storage_options: dict | None = None) -> bool:
    if not is_remote(path):
        return Path(path).is_dir() and any(Path(path).iterdir())
    return not _store(path, storage_options).is_empty(path)


def index_samples(split_dir: str, storage_options: dict | None = None) -> int | None:
    """Samples listed in a split's index.json (litdata.optimize writes it last), None without one."""
    index = read_json(join(split_dir, "index.json"), storage_options)
    return None if index is None else sum(int(c["chunk_size"]) for c in index["chunks"])


def read_metadata(input_dir: str, storage_options: dict | None = None) -> dict:
    """prepare.json of a prepared dataset; a ConfigError that says what to run when it is missing or unfinished."""
    path = join(input_dir, METADATA)
    try:
        meta = read_json(path, storage_options)
    except Exception as err:  # no such bucket, no credentials, endpoint unreachable, ...
        raise ConfigError(
            f"Cannot read '{path}' ({type(err).__name__}: {err}). For an object store, set AWS_ACCESS_KEY_ID/"
            "AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL for an S3-compatible one) or --data.init_args.storage_options."
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
    return meta


def check_split(input_dir: str, split: str, meta: dict, storage_options: dict | None = None) -> None:
    """Check a split before a run reads it: its index.json lists prepare.json's sample count; locally every chunk
    file it lists is there, with the size and header it lists (a few bytes read)."""
    split_dir, index_path = join(input_dir, split), join(input_dir, split, "index.json")
    root = f" --root {meta['root']}" if meta.get("root") else ""
    size = f" --image_size {meta['image_size']}" if meta.get("image_size") else ""
    fix = f"Write the dataset again: python -m project prepare --source {meta['source']}{root} --output_dir {input_dir}{size} --overwrite true"
    if (index := read_json(index_path, storage_options)) is None:
        raise ConfigError(f"'{index_path}' is missing: the {split} split cannot be read. {fix}")
    files = [(c["filename"], int(c["chunk_size"]), int(c["chunk_bytes"])) for c in index["chunks"]]
    listed = sum(n for _, n, _ in files)
    if listed != meta["splits"][split]:
        raise ConfigError(
            f"'{index_path}' lists {listed} samples, but {METADATA} says the {split} split has "
            f"{meta['splits'][split]}. {fix}"
        )
    for name, n, size in [] if is_remote(input_dir) else files:
        path = Path(split_dir, name)
        if not path.is_file():
            raise ConfigError(f"'{path}' is missing (listed in '{index_path}'). {fix}")
        head = np.fromfile(path, np.uint32, count=n + 2)
        fits = path.stat().st_size == size and len(head) == n + 2 and not any(np.diff(head[1:]) < 0)
        if not fits or (head[0], head[1], head[-1]) != (n, 4 * (n + 2), size):
            raise ConfigError(
                f"'{path}' is damaged: its size or header does not describe the {n} samples and {size} bytes "
                f"that '{index_path}' lists (truncated or overwritten?). {fix}"
            )

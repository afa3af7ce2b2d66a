"""`python scripts/gpu_check_repack.py DIR NAME...`: wheels of installed distributions, rebuilt from their RECORD.

The GPU check's dry-run needs the wheels that `scripts/gpu_check.sh --prepare` downloads, but `make test` runs
offline. Without a prepared folder, the dry-run repacks this environment's installed copies of the same packages
(the versions constraints.txt pins) into wheels here, and installs those with the very `pip install --no-index
--no-deps --target` line the GPU machine runs. A wheel is a zip of the installed files plus the `.dist-info`
folder; RECORD lists both. Byte-compiled files are left out (pip compiles again) and RECORD is rewritten with
fresh hashes.
"""

import base64
import hashlib
import sys
import zipfile
from importlib import metadata
from pathlib import Path


def _digest(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def repack(name: str, out: Path) -> Path:
    dist = metadata.distribution(name)
    info = next(f for f in dist.files if f.parts[0].endswith(".dist-info"))
    dist_info = info.parts[0]
    stem = dist_info.removesuffix(".dist-info")
    path = out / f"{stem}-py3-none-any.whl"
    record = []
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as whl:
        for f in dist.files:
            skip = f.suffix == ".pyc" or f.parts[0] == ".." or f.name in ("RECORD", "INSTALLER", "REQUESTED")
            if skip or f.name == "direct_url.json":
                continue
            data = Path(f.locate()).read_bytes()
            whl.writestr(f.as_posix(), data)
            record.append(f"{f.as_posix()},{_digest(data)},{len(data)}")
        record.append(f"{dist_info}/RECORD,,")
        whl.writestr(f"{dist_info}/RECORD", "\n".join(record) + "\n")
    return path


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for name in sys.argv[2:]:
        print(f"repacked {repack(name, out).name} from this environment (no prepared wheels; offline)")


if __name__ == "__main__":
    main()

"""`python scripts/gpu_check_repack.py DIR NAME...`: wheels of installed distributions, rebuilt from their RECORD.

The dry-run of the GPU check runs offline (make test): without prepared wheels it repacks this environment's copies
of the same packages and installs them with the GPU machine's own pip line. Byte-code is left out (pip compiles
again) and RECORD gets fresh hashes.
"""

import base64
import hashlib
import sys
import zipfile
from importlib import metadata
from pathlib import Path


def repack(name: str, out: Path) -> Path:
    dist = metadata.distribution(name)
    dist_info = next(f for f in dist.files if f.parts[0].endswith(".dist-info")).parts[0]
    path, record = out / f"{dist_info.removesuffix('.dist-info')}-py3-none-any.whl", []
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as whl:
        for f in dist.files:
            if (
                f.suffix == ".pyc"
                or f.parts[0] == ".."
                or f.name in ("RECORD", "INSTALLER", "REQUESTED", "direct_url.json")
            ):
                continue
            data = Path(f.locate()).read_bytes()
            whl.writestr(f.as_posix(), data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{f.as_posix()},sha256={digest},{len(data)}")
        whl.writestr(f"{dist_info}/RECORD", "\n".join([*record, f"{dist_info}/RECORD,,"]) + "\n")
    return path


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for name in sys.argv[2:]:
        print(f"repacked {repack(name, out).name} from this environment (no prepared wheels; offline)")

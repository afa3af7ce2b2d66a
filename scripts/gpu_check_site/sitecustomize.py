"""The GPU check's dry-run only: packages the GPU machine lacks ($GPU_CHECK_HIDE) import from the folder the wheels
went into ($GPU_CHECK_SITE, as far as it is on sys.path) or not at all, so a wheel missing from the set fails here."""

import importlib.machinery
import os
import sys

HIDDEN = set(os.environ.get("GPU_CHECK_HIDE", "").split())
ALLOWED = {os.path.realpath(p) for p in os.environ.get("GPU_CHECK_SITE", "").split(os.pathsep) if p}


class _OnlyFromWheels:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name not in HIDDEN:  # submodules are found through their parent's __path__
            return None
        where = [p for p in sys.path if p and os.path.realpath(p) in ALLOWED]
        if spec := importlib.machinery.PathFinder.find_spec(name, where):
            return spec
        raise ModuleNotFoundError(f"No module named '{name}' (hidden by the GPU check's dry-run)", name=name)


if HIDDEN:
    sys.meta_path.insert(0, _OnlyFromWheels())

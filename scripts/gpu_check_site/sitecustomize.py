"""`scripts/gpu_check.sh --dry-run` only: hide packages of this environment that the GPU machine lacks.

Python imports `sitecustomize` at start-up from the first sys.path entry that has one; the dry-run puts this folder
on PYTHONPATH with GPU_CHECK_HIDE="jsonargparse docstring_parser ..." and GPU_CHECK_SITE=<the --target folder the
wheels went into>. Each hidden top-level package then imports from that folder or not at all (ModuleNotFoundError,
as on the GPU machine), so a wheel missing from the prepared set fails the dry-run here instead of the GPU run.
"""

import importlib.machinery
import os
import sys

HIDDEN = set(os.environ.get("GPU_CHECK_HIDE", "").split())
ALLOWED = [p for p in os.environ.get("GPU_CHECK_SITE", "").split(os.pathsep) if p]


class _OnlyFromWheels:
    """A meta-path finder: hidden packages are looked up in the wheels' folder alone."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.partition(".")[0] not in HIDDEN or "." in name:
            return None  # not hidden, or a submodule: found through its parent's __path__ (in the wheels' folder)
        # Only where the GPU machine would look: the wheels' folder as far as it is on sys.path (PYTHONPATH).
        allowed = {os.path.realpath(p) for p in ALLOWED}
        spec = importlib.machinery.PathFinder.find_spec(
            name, [p for p in sys.path if p and os.path.realpath(p) in allowed]
        )
        if spec is None:
            raise ModuleNotFoundError(
                f"No module named '{name}' (hidden by the GPU check's dry-run)", name=name
            )
        return spec


if HIDDEN:
    sys.meta_path.insert(0, _OnlyFromWheels())

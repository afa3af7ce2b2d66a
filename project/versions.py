"""One line when an installed package is outside the range pyproject.toml pins (read from the installed metadata).

Past the pins, a run may fail inside a package rather than here: the template relies on a few of Lightning's
private names (listed in README "Your own environment"). The line says which package, which range was tested, and
the command that installs it; nothing stops the run.
"""

import sys
from importlib import metadata

WATCHED = ("torch", "lightning", "torchmetrics", "torchvision", "jsonargparse")


def outside_pins(distribution: str = "project") -> list[str]:
    """'<requirement> (installed: <version>)' for each WATCHED package whose installed version the pin excludes."""
    from packaging.requirements import Requirement

    try:
        requirements = metadata.requires(distribution) or []
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed: nothing to compare
        return []
    found = []
    for line in requirements:
        req = Requirement(line)
        if req.name not in WATCHED or req.marker is not None or not req.specifier:
            continue
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            continue
        if not req.specifier.contains(version, prereleases=True):
            found.append(f"{req} (installed: {version})")
    return found


def warn_outside_pins() -> None:
    if found := outside_pins():
        quoted = " ".join(f"'{f.split(' (installed')[0]}'" for f in found)
        print(
            f"note: outside the tested versions: {'; '.join(found)}. If the run fails inside Lightning, install "
            f'the tested range: {sys.executable} -m pip install {quoted} (README "Your own environment").',
            file=sys.stderr,
            flush=True,
        )


def built_by_cli() -> bool:
    """Whether the module being constructed is built by LightningCLI, which saves nested classes (model,
    optimizer, dataset) as their config; built in code they are objects, which save_hyperparameters must not pickle.
    Lightning offers no public way to ask. Without the private name (a release past the pin) it answers False: the
    nested objects are then left out of the hyperparameters, and a checkpoint needs its config to be rebuilt."""
    try:  # Lightning's record of the hyperparameters LightningCLI parsed (imported here: this module's pin check
        # runs before Lightning is imported)
        from lightning.pytorch.core.mixins.hparams_mixin import _given_hyperparameters
    except ImportError:  # renamed past the pin: every module counts as built in code
        return False
    return _given_hyperparameters.get() is not None

"""What the installed packages are: past the pins of pyproject.toml, one line saying so; and whether LightningCLI
builds the module, which Lightning offers no public way to ask.

Past the pins a run may fail inside a package rather than here (the template relies on a few of Lightning's private
names, README "Your own environment"), so the line names the tested range and the install command; the run goes on.
"""

import sys
from importlib import metadata

WATCHED = ("torch", "lightning", "torchmetrics", "torchvision", "jsonargparse")


def outside_pins(distribution: str = "project") -> list[str]:
    """'<requirement> (installed: <version>)' for each WATCHED package whose installed version the pin excludes."""
    from packaging.requirements import Requirement

    try:
        requirements = [Requirement(line) for line in metadata.requires(distribution) or []]
    except metadata.PackageNotFoundError:  # a checkout that was never installed: nothing to compare
        return []
    found = []
    for req in requirements:
        if req.name in WATCHED and req.marker is None and req.specifier:
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
    """Whether LightningCLI builds the module now: it saves nested classes (model, optimizer, dataset) as their
    config, while built in code they are objects that save_hyperparameters must not pickle. Without the private
    name (a Lightning past the pin) the answer is False: a checkpoint then needs its config to be rebuilt."""
    try:  # imported here: the pin check runs before Lightning is imported
        from lightning.pytorch.core.mixins.hparams_mixin import _given_hyperparameters
    except ImportError:
        return False
    return _given_hyperparameters.get() is not None

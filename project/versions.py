"""Installed packages past the pins of pyproject.toml (the template relies on a few of Lightning's private names:
one line names the tested range; the run goes on), and whether LightningCLI builds the module."""

import sys
from importlib import metadata

WATCHED = ("torch", "lightning", "torchmetrics", "torchvision", "jsonargparse")


def outside_pins(distribution: str = "project") -> list[str]:
    from packaging.requirements import Requirement

    try:
        requirements = [Requirement(line) for line in metadata.requires(distribution) or []]
    except metadata.PackageNotFoundError:  # a checkout that was never installed
        return []
    watched = [
        (req, metadata.version(req.name)) for req in requirements if req.name in WATCHED and not req.marker
    ]
    return [
        f"{req} (installed: {v})" for req, v in watched if not req.specifier.contains(v, prereleases=True)
    ]


def warn_outside_pins() -> None:
    if found := outside_pins():
        quoted = " ".join(f"'{f.split(' (installed')[0]}'" for f in found)
        sys.stderr.write(
            f"note: outside the tested versions: {'; '.join(found)}. If the run fails inside Lightning, install "
            f'the tested range: {sys.executable} -m pip install {quoted} (README "Your own environment").\n'
        )


def built_by_cli() -> bool:
    """Whether LightningCLI builds the module now (nested classes are then saved as their config; built in code
    they are objects save_hyperparameters must not pickle). Lightning offers no public way to ask."""
    try:  # imported here: the pin check runs before Lightning is imported
        from lightning.pytorch.core.mixins.hparams_mixin import _given_hyperparameters
    except ImportError:
        return False
    return _given_hyperparameters.get() is not None

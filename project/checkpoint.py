"""Reading checkpoints: the one reader every command uses, and what a checkpoint is allowed to name.

- read_checkpoint(path): torch.load(weights_only=True) with errors that name the file, what is wrong and the fix.
  Unpickling never runs code from the file; Lightning's resume goes through torch.load too, whose default is
  also weights_only=True since torch 2.6.
- check_checkpoint(path, module): before resuming, a checkpoint of another architecture or other classes is
  reported with the tensors that differ instead of a size-mismatch traceback.
- check_class_paths / import_class: the hyperparameters stored in a checkpoint name the classes that rebuild
  its model (`_class_path`, nested `class_path`s). Importing a module runs its code, so every name is checked
  against an allowlist (this project, torchvision.models, torch.nn, torch.optim, plus what the user passes with
  --allow_class) before anything is imported. Lightning's `load_from_checkpoint` checks only the top-level
  class, and its `instantiate_module` imports every nested class path the file names; `weights_only=True`
  guards the unpickling, not this. A run's config.yaml, which export reads for a data module that saved no
  hyperparameters, is no more trusted than the checkpoint: held to the same list.

This file imports only torch: predict and export read checkpoints without importing Lightning (~3 s). Writing
checkpoints is project/checkpoint_io.py (AtomicCheckpointIO, a Lightning plugin).
"""

import importlib
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from project.errors import ConfigError

# Module prefixes whose classes a checkpoint may name without --allow_class: the classes this project's configs
# use (its models, module, data module and schedules), torchvision's classifiers, torch's layers and optimizers.
ALLOWED = ("project", "torchvision.models", "torch.nn", "torch.optim")
_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")


def read_checkpoint(path: str | os.PathLike, mmap: bool = False) -> dict:
    """torch.load(weights_only=True) with ConfigErrors that name the file and what is wrong with it.

    mmap=True reads only the index of the file (tensors are mapped lazily): a cheap validity check.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"Checkpoint '{path}' does not exist. Pass a .ckpt file written by `make train`: "
            "--ckpt_path runs/<run>/checkpoints/last.ckpt (or best-epoch=NNN.ckpt); with make predict or "
            "make export: CKPT=runs/<run>/checkpoints/last.ckpt."
        )
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as err:  # truncated zip, random bytes, a pickle with code in it, ...
        reason = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"Checkpoint '{path}' ({path.stat().st_size} bytes) cannot be read with weights_only=True: {reason}. "
            "It is truncated, corrupt, not a PyTorch file, or holds pickled objects (code) that safe loading "
            "refuses. Use another checkpoint of the run (its checkpoints/ folder), e.g. --ckpt_path last."
        ) from err
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        keys = sorted(checkpoint)[:8] if isinstance(checkpoint, dict) else type(checkpoint).__name__
        raise ConfigError(
            f"'{path}' is a PyTorch file but not a Lightning checkpoint of this template (no 'state_dict'; found "
            f"{keys}). Pass a .ckpt written by `python -m project fit` (runs/<run>/checkpoints/)."
        )
    return checkpoint


def check_checkpoint(path: str | os.PathLike, module: nn.Module) -> None:
    """Before resuming: fail clearly if the checkpoint's tensors do not fit `module` (names and shapes)."""
    theirs = {
        k: tuple(v.shape)
        for k, v in read_checkpoint(path, mmap=True)["state_dict"].items()
        if hasattr(v, "shape")
    }
    ours = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    missing = [k for k in ours if k not in theirs]
    unexpected = [k for k in theirs if k not in ours]
    shapes = [
        f"{k}: checkpoint {theirs[k]} vs model {ours[k]}"
        for k in ours
        if k in theirs and theirs[k] != ours[k]
    ]
    if missing or unexpected or shapes:
        parts = []
        if shapes:
            parts.append(f"{len(shapes)} tensors differ in shape ({'; '.join(shapes[:3])})")
        if missing:
            parts.append(f"{len(missing)} of the model's tensors are absent ({', '.join(missing[:3])})")
        if unexpected:
            parts.append(f"{len(unexpected)} tensors are not in the model ({', '.join(unexpected[:3])})")
        raise ConfigError(
            f"Checkpoint '{path}' was written by a different model or for a different number of classes: "
            f"{'; '.join(parts)}. Resume with the config and data the run was started with (its config.yaml: "
            "--config runs/<run>/config.yaml), or start a new run without --ckpt_path."
        )


def named_classes(tree: Any, dotted_strings: bool = False, where: str = "") -> Iterator[tuple[str, str]]:
    """(where, name) for every `class_path`/`_class_path` value in nested dicts and lists.

    dotted_strings=True also yields every other string that reads as a dotted import path (`a.b.C`): jsonargparse,
    which Lightning's instantiate_module uses, imports such a string where a parameter's type is a class or a
    callable, so those routes check them too.
    """
    if isinstance(tree, dict):
        for key, value in tree.items():
            at = f"{where}.{key}" if where else str(key)
            if key in ("class_path", "_class_path") or (
                dotted_strings and isinstance(value, str) and _DOTTED.fullmatch(value)
            ):
                yield at, value if isinstance(value, str) else repr(value)
            else:
                yield from named_classes(value, dotted_strings, at)
    elif isinstance(tree, list | tuple):
        for i, value in enumerate(tree):
            yield from named_classes(value, dotted_strings, f"{where}[{i}]")
    elif dotted_strings and isinstance(tree, str) and _DOTTED.fullmatch(tree):
        yield where, tree


def allowed(allow_class: str | Iterable[str] | None) -> tuple[str, ...]:
    """The --allow_class value (one name, a list, or None) as a tuple of names."""
    if allow_class is None:
        return ()
    return (allow_class,) if isinstance(allow_class, str) else tuple(allow_class)


def is_allowed(name: str, allow: Iterable[str] = ()) -> bool:
    """A dotted name inside one of ALLOWED or the user's --allow_class entries (a class or a module prefix)."""
    if not isinstance(name, str) or not _DOTTED.fullmatch(name):
        return False
    return any(name == a or name.startswith(a + ".") for a in (*ALLOWED, *allow))


def check_class_paths(
    tree: Any, allow: Iterable[str] = (), path: str | os.PathLike = "checkpoint", dotted_strings: bool = False
) -> None:
    """Raise a one-paragraph ConfigError, before anything is imported, if `tree` names a class outside the allowlist."""
    allow = tuple(allow)
    refused = [(at, name) for at, name in named_classes(tree, dotted_strings) if not is_allowed(name, allow)]
    if refused:
        names = sorted({name for _, name in refused})
        listed = ", ".join(f"{name} (at {at})" for at, name in refused[:5])
        flags = f"--allow_class {names[0]}" if len(names) == 1 else f"--allow_class '[{', '.join(names)}]'"
        raise ConfigError(
            f"Checkpoint '{path}' names code outside the allowlist: {listed}. Rebuilding its model would import "
            "and run that code, so nothing was imported. Allowed without a flag: "
            f"{', '.join(a + '.*' for a in ALLOWED)}. If you trust this checkpoint and the code it names, "
            f'allow it explicitly: {flags} (make predict or make export: ARGS="{flags}").'
        )


def import_class(name: str, allow: Iterable[str] = ()) -> Any:
    """The attribute `name` (module.Class) once it passed the allowlist: the module is imported only then."""
    if not is_allowed(name, allow):  # the caller checked the whole tree; this keeps the importer safe alone
        check_class_paths({"class_path": name}, allow)
    module, _, attr = name.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(
            f"The checkpoint's model needs '{name}', which cannot be imported here ({err}). Make its module "
            "importable (install its package or add its folder to PYTHONPATH), as it was when the model was trained."
        ) from err


def instantiate(spec: Any, allow: Iterable[str] = ()) -> Any:
    """Build `{class_path, init_args}` specs (nested ones first) with plain calls; other values pass through.

    A small importer instead of jsonargparse or Lightning's instantiate_module: the stored init_args are already
    resolved values (links filled in), and predict and export must not import Lightning. Strings are never
    imported here.
    """
    if isinstance(spec, dict) and "class_path" in spec:
        cls = import_class(spec["class_path"], allow)
        kwargs = {**(spec.get("init_args") or {}), **(spec.get("dict_kwargs") or {})}
        return cls(**{k: instantiate(v, allow) for k, v in kwargs.items()})
    if isinstance(spec, dict):
        return {k: instantiate(v, allow) for k, v in spec.items()}
    if isinstance(spec, list):
        return [instantiate(v, allow) for v in spec]
    return spec

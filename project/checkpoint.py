"""Reading checkpoints safely: weights_only=True, and every class a checkpoint names held to an allowlist before
anything is imported (importing runs code; weights_only guards only the unpickling, and Lightning's
instantiate_module imports every nested class). Imports only torch: predict and export start without Lightning."""

import importlib.util
import io
import os
import pkgutil
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from project.errors import ConfigError

# Module prefixes a checkpoint may name without --allow_class: what this project's configs use.
ALLOWED = ("project", "torchvision.models", "torch.nn", "torch.optim")
_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")


def s3_through_obstore() -> None:
    """fsspec's s3:// through obstore (the `stream` extra), unless s3fs is installed: no s3fs release resolves against
    litdata's botocore. A key written by one upload is seen whole or not at all."""
    if not importlib.util.find_spec("s3fs") and importlib.util.find_spec("obstore"):
        import obstore.fsspec

        obstore.fsspec.register("s3")


def filesystem(url: str):
    import fsspec

    s3_through_obstore()
    return fsspec.url_to_fs(url)[0]


def read_checkpoint(path: str | os.PathLike, mmap: bool = False) -> dict:
    """torch.load(weights_only=True) of a file or URL, with errors that name it, what is wrong and the fix."""
    fs = filesystem(str(path)) if "://" in str(path) else None
    path = str(path) if fs else Path(path)
    if not (fs.isfile(path) if fs else path.is_file()):
        raise ConfigError(
            f"Checkpoint '{path}' does not exist. Pass a .ckpt file written by `make train`: --ckpt_path "
            "runs/<run>/checkpoints/last.ckpt (make predict, make export: CKPT=runs/<run>/checkpoints/last.ckpt)."
        )
    try:
        source = io.BytesIO(fs.cat_file(path)) if fs else path
        checkpoint = torch.load(source, map_location="cpu", weights_only=True, mmap=mmap and not fs)
    except Exception as err:  # truncated zip, random bytes, a pickle with code in it
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise ConfigError(
            f"Checkpoint '{path}' ({fs.size(path) if fs else path.stat().st_size} bytes) cannot be read with weights_only=True: {reason}. "
            "It is truncated, corrupt, not a PyTorch file, or holds pickled objects (code) that safe loading "
            "refuses. Use another checkpoint of the run (its checkpoints/ folder), e.g. --ckpt_path last."
        ) from err
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        found = sorted(checkpoint)[:8] if isinstance(checkpoint, dict) else type(checkpoint).__name__
        raise ConfigError(
            f"'{path}' is a PyTorch file but not a Lightning checkpoint of this template (no 'state_dict'; found "
            f"{found}). Pass a .ckpt written by `python -m project fit` (runs/<run>/checkpoints/)."
        )
    return checkpoint


def check_checkpoint(path: str | os.PathLike, module: nn.Module) -> None:
    """Before a resume: tensors that do not fit `module` in one paragraph, instead of a size-mismatch traceback."""
    state = read_checkpoint(path, mmap=True)["state_dict"]
    theirs = {k: tuple(v.shape) for k, v in state.items() if hasattr(v, "shape")}
    ours = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    found = {
        "tensors differ in shape": [
            f"{k}: checkpoint {theirs[k]} vs model {v}" for k, v in ours.items() if theirs.get(k, v) != v
        ],
        "of the model's tensors are absent": [k for k in ours if k not in theirs],
        "tensors are not in the model": [k for k in theirs if k not in ours],
    }
    if parts := [f"{len(keys)} {what} ({'; '.join(keys[:3])})" for what, keys in found.items() if keys]:
        raise ConfigError(
            f"Checkpoint '{path}' was written by a different model or for a different number of classes: "
            f"{'; '.join(parts)}. Resume with the config and data the run was started with (its config.yaml: "
            "--config runs/<run>/config.yaml), or start a new run without --ckpt_path."
        )


def named_classes(tree: Any, dotted_strings: bool = False, at: str = ""):
    """(where, name) for every `class_path`/`_class_path` in nested dicts and lists; with dotted_strings, every
    string that reads as `a.b.C` too (jsonargparse imports one where a parameter's type is a class or callable)."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            where = f"{at}.{key}" if at else str(key)
            if key in ("class_path", "_class_path"):
                yield where, str(value)
            else:
                yield from named_classes(value, dotted_strings, where)
    elif isinstance(tree, list | tuple):
        for i, value in enumerate(tree):
            yield from named_classes(value, dotted_strings, f"{at}[{i}]")
    elif dotted_strings and isinstance(tree, str) and _DOTTED.fullmatch(tree):
        yield at, tree


def check_class_paths(tree: Any, allow=(), path: Any = "checkpoint", dotted_strings: bool = False) -> None:
    """Refuse, before anything is imported, a name in `tree` outside ALLOWED and `allow` (--allow_class: one
    name or a list; each a class or a module prefix: `torch.nn` allows `torch.nn.ReLU`, not `torch.nn_evil.X`)."""
    allow = (*ALLOWED, *((allow,) if isinstance(allow, str) else allow or ()))
    refused = [
        (at, name)
        for at, name in named_classes(tree, dotted_strings)
        if not (_DOTTED.fullmatch(name) and any(name == a or name.startswith(a + ".") for a in allow))
    ]
    if refused:
        names = sorted({name for _, name in refused})
        flag = f"--allow_class {names[0]}" if len(names) == 1 else f"--allow_class '[{', '.join(names)}]'"
        raise ConfigError(
            f"Checkpoint '{path}' names code outside the allowlist: "
            f"{', '.join(f'{name} (at {at})' for at, name in refused[:5])}. Rebuilding its model would import and "
            f"run that code, so nothing was imported. Allowed without a flag: {', '.join(a + '.*' for a in ALLOWED)}."
            f" If you trust this checkpoint and the code it names, allow it explicitly: {flag} (make predict or make "
            f'export: ARGS="{flag}").'
        )


def instantiate(spec: Any, allow=()) -> Any:
    """Build `{class_path, init_args}` specs, nested ones first, by plain calls; strings are never imported (the
    stored init_args are resolved values already: no jsonargparse, no Lightning)."""
    if isinstance(spec, list):
        return [instantiate(v, allow) for v in spec]
    if not isinstance(spec, dict):
        return spec
    if "class_path" not in spec:
        return {k: instantiate(v, allow) for k, v in spec.items()}
    check_class_paths({"class_path": spec["class_path"]}, allow)  # safe even where the caller checked nothing
    try:
        cls = pkgutil.resolve_name(spec["class_path"])
    except (ImportError, AttributeError) as err:
        raise ConfigError(
            f"The checkpoint's model needs '{spec['class_path']}', which cannot be imported here ({err}). Make its "
            "module importable (install its package or add its folder to PYTHONPATH), as when it was trained."
        ) from err
    kwargs = {**(spec.get("init_args") or {}), **(spec.get("dict_kwargs") or {})}
    return cls(**{k: instantiate(v, allow) for k, v in kwargs.items()})

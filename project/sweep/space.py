"""The sweep file (configs/sweep/*.yaml): what a sweep searches, with which sampler and pruner, for how long.

Keys of `params` and `fixed` are the dotted keys of the training CLI (`model.init_args.optimizer.init_args.lr`,
as in `python -m project fit --model.init_args.optimizer.init_args.lr 0.01`); a trial's config is those keys
as one YAML overlay on the base config, so a trial is `make train` with a second `--config`.
"""

import copy
import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from project.errors import ConfigError

KINDS = ("float", "int", "categorical")
TOP_KEYS = ("name", "n_trials", "metric", "direction", "enqueue_base", "sampler", "pruner", "fixed", "params")


@dataclass
class SweepSpace:
    """A parsed sweep file. `metric`/`direction` None: the base config's checkpoint monitor and mode."""

    name: str
    n_trials: int
    params: dict[str, dict]
    fixed: dict[str, Any] = field(default_factory=dict)
    metric: str | None = None
    direction: str | None = None
    enqueue_base: bool = True
    sampler: dict | None = None
    pruner: dict | None = None

    def sample(self, trial) -> dict[str, Any]:
        """One value per parameter from an optuna Trial, keyed by the dotted CLI key."""
        values = {}
        for key, spec in self.params.items():
            kind = spec["type"]
            if kind == "float":
                values[key] = trial.suggest_float(
                    key, spec["low"], spec["high"], log=spec.get("log", False), step=spec.get("step")
                )
            elif kind == "int":
                values[key] = trial.suggest_int(
                    key, spec["low"], spec["high"], log=spec.get("log", False), step=spec.get("step", 1)
                )
            else:
                values[key] = trial.suggest_categorical(key, spec["choices"])
        return values

    def build_sampler(self, seed_offset: int = 0):
        spec = copy.deepcopy(self.sampler or {"class_path": "optuna.samplers.TPESampler"})
        init = spec.setdefault("init_args", {}) or {}
        if init.get("seed") is not None:  # each worker draws its own numbers (same seed: same draws)
            init["seed"] = int(init["seed"]) + seed_offset
        return instantiate(spec, "sampler")

    def build_pruner(self):
        return instantiate(self.pruner or {"class_path": "optuna.pruners.NopPruner"}, "pruner")


def instantiate(spec: dict, what: str):
    """{class_path: optuna.pruners.MedianPruner, init_args: {...}} -> the object (as LightningCLI configs do)."""
    path = spec.get("class_path", "")
    module_name, _, class_name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
        return cls(**(spec.get("init_args") or {}))
    except (ImportError, AttributeError, ValueError, TypeError) as err:
        raise ConfigError(
            f"The sweep file's {what} '{path}' could not be built ({err}). Give an importable class_path, e.g. "
            f"optuna.{what}s.{'TPESampler' if what == 'sampler' else 'MedianPruner'}, and its init_args."
        ) from err


def load_space(path: str | Path) -> SweepSpace:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"Sweep file '{path}' not found. Pass one with --space, e.g. configs/sweep/digits.yaml."
        )
    raw = yaml.safe_load(path.read_text()) or {}
    unknown = set(raw) - set(TOP_KEYS)
    if unknown:
        raise ConfigError(
            f"{path}: unknown key(s) {sorted(unknown)}; a sweep file has {', '.join(TOP_KEYS)}."
        )
    params = raw.get("params") or {}
    if not params:
        raise ConfigError(
            f"{path}: `params` is empty; add at least one dotted key with a range, e.g. "
            "model.init_args.optimizer.init_args.lr: {type: float, low: 1.0e-4, high: 1.0e-2, log: true}"
        )
    for key, spec in params.items():
        check_param(path, key, spec)
    direction = raw.get("direction")
    if direction not in (None, "minimize", "maximize"):
        raise ConfigError(
            f"{path}: direction '{direction}' must be minimize, maximize or null (the monitor's mode)."
        )
    return SweepSpace(
        name=str(raw.get("name") or path.stem),
        n_trials=int(raw.get("n_trials") or 20),
        params=params,
        fixed=dict(raw.get("fixed") or {}),
        metric=raw.get("metric"),
        direction=direction,
        enqueue_base=bool(raw.get("enqueue_base", True)),
        sampler=raw.get("sampler"),
        pruner=raw.get("pruner"),
    )


def check_param(path: Path, key: str, spec: Any) -> None:
    example = "{type: float, low: 1.0e-4, high: 1.0e-2, log: true} or {type: categorical, choices: [32, 64]}"
    if not isinstance(spec, dict) or spec.get("type") not in KINDS:
        raise ConfigError(f"{path}: parameter '{key}' needs a type ({', '.join(KINDS)}), e.g. {example}.")
    if spec["type"] == "categorical":
        if not spec.get("choices"):
            raise ConfigError(f"{path}: categorical parameter '{key}' needs a non-empty `choices` list.")
    elif "low" not in spec or "high" not in spec or spec["low"] > spec["high"]:
        raise ConfigError(f"{path}: parameter '{key}' needs low <= high, e.g. {example}.")


def nest(dotted: dict[str, Any]) -> dict:
    """{'a.b.c': 1} -> {'a': {'b': {'c': 1}}}: the YAML overlay that `--a.b.c 1` means on the command line."""
    tree: dict = {}
    for key, value in dotted.items():
        node = tree
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"Sweep keys clash: '{key}' goes below a key that has a value of its own.")
        node[leaf] = value
    return tree


def merge(base: dict, overlay: dict) -> dict:
    """Deep merge of YAML mappings, the later one winning (how a second --config overrides the first)."""
    out = copy.deepcopy(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def lookup(tree: dict, dotted: str) -> Any:
    """The value at a dotted key of a YAML mapping, or KeyError when the configs do not spell it out."""
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(dotted)
        node = node[part]
    return node


def base_values(space: SweepSpace, configs: list[str]) -> dict[str, Any]:
    """The base configs' own value of each parameter the YAML files spell out (for the first, enqueued trial)."""
    tree: dict = {}
    for config in configs:
        tree = merge(tree, yaml.safe_load(Path(config).read_text()) or {})
    tree = merge(tree, nest(space.fixed))
    values = {}
    for key, spec in space.params.items():
        try:
            value = lookup(tree, key)
        except KeyError:
            continue
        if spec["type"] == "categorical" and value not in spec["choices"]:
            continue
        if spec["type"] != "categorical" and not (spec["low"] <= value <= spec["high"]):
            continue
        values[key] = value
    return values

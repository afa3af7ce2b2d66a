"""The sweep file (configs/sweep/*.yaml): what a sweep searches, with which sampler and pruner, for how long.

Keys of `params` and `fixed` are the training CLI's dotted keys; a trial's config is those keys as one YAML overlay
on the base config, so a trial is `make train` with a second `--config`. A parameter holds the arguments of
Optuna's `suggest_<type>` (low, high, log, step; choices), checked by building its Optuna distribution.
"""

import copy
import importlib
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from project.errors import ConfigError

DISTRIBUTIONS = {"float": FloatDistribution, "int": IntDistribution, "categorical": CategoricalDistribution}
NO_PRUNER = {"class_path": "optuna.pruners.NopPruner"}
EXAMPLE = "{type: float, low: 1.0e-4, high: 1.0e-2, log: true} or {type: categorical, choices: [32, 64]}"


@dataclass
class SweepSpace:
    """A parsed sweep file. `metric`/`direction` None: the base config's checkpoint monitor and mode."""

    name: str
    n_trials: int = 20
    metric: str | None = None
    direction: str | None = None
    enqueue_base: bool = True
    sampler: dict | None = None
    pruner: dict | None = None
    fixed: dict[str, Any] = field(default_factory=dict)
    params: dict[str, dict] = field(default_factory=dict)

    def sample(self, trial) -> dict[str, Any]:
        params = copy.deepcopy(self.params)
        return {k: getattr(trial, f"suggest_{s.pop('type')}")(k, **s) for k, s in params.items()}

    def build_sampler(self, seed_offset: int = 0):
        spec = copy.deepcopy(self.sampler or {"class_path": "optuna.samplers.TPESampler"})
        init = spec.setdefault("init_args", {}) or {}
        if init.get("seed") is not None:  # each worker draws its own numbers (same seed: same draws)
            init["seed"] = int(init["seed"]) + seed_offset
        return instantiate(spec, "sampler")


TOP_KEYS = [f.name for f in fields(SweepSpace)]


def instantiate(spec: dict, what: str):
    """{class_path: optuna.pruners.MedianPruner, init_args: {...}} -> the object (as LightningCLI configs do)."""
    path = str(spec.get("class_path"))
    try:
        module, _, name = path.rpartition(".")
        return getattr(importlib.import_module(module), name)(**(spec.get("init_args") or {}))
    except (ImportError, AttributeError, ValueError, TypeError) as err:
        message = f"The sweep file's {what} '{path}' could not be built ({err})"
        raise ConfigError(f"{message}: give an importable class_path and its init_args.") from err


def load_space(path: str | Path) -> SweepSpace:
    """Parse and check a sweep file: every problem found is named in one ConfigError paragraph, with its fix."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"Sweep file '{path}' not found: give one with --space (configs/sweep/*.yaml).")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {' '.join(str(err).split())}") from err
    if not isinstance(raw, dict) or set(raw) - set(TOP_KEYS):
        unknown = f" (not {sorted(set(raw) - set(TOP_KEYS))})" if isinstance(raw, dict) else ""
        raise ConfigError(f"{path}: a sweep file is a mapping with the keys {', '.join(TOP_KEYS)}{unknown}.")
    given = {k: v for k, v in raw.items() if v is not None}  # null: the default
    space = SweepSpace(**{"name": path.stem, **given})
    params, fixed, problems = space.params, space.fixed, []
    if not isinstance(params, dict) or not params:
        problems.append(f"`params` needs dotted keys with ranges, e.g. {EXAMPLE}")
    if not isinstance(fixed, dict):
        problems.append("`fixed` maps dotted keys to values, e.g. trainer.max_epochs: 5")
    if space.direction not in (None, "minimize", "maximize") or space.metric and not space.direction:
        problems.append("direction is minimize or maximize (null with metric null: the monitor's)")
    if type(space.n_trials) is not int or space.n_trials < 1:
        problems.append(f"n_trials {space.n_trials!r} is not a whole number above 0")
    if isinstance(params, dict) and isinstance(fixed, dict):
        problems += [p for p in (param_problem(key, spec) for key, spec in params.items()) if p]
        problems += [f"'{k}' is searched and fixed: keep one" for k in set(params) & set(fixed)]
    if problems:
        raise ConfigError(f"{path}: " + "; ".join(problems) + ". Nothing was run.")
    space.name = str(space.name)
    space.build_sampler()  # a class path that does not build: a ConfigError of its own
    instantiate(space.pruner or NO_PRUNER, "pruner")
    return space


def param_problem(key: str, spec: Any) -> str | None:
    """What is wrong with one parameter's range (Optuna would refuse it in every trial)."""
    name, kind = f"parameter '{key}'", spec.get("type") if isinstance(spec, dict) else spec
    if kind not in DISTRIBUTIONS:
        return f"{name} has type {kind!r}; it needs a type ({', '.join(DISTRIBUTIONS)}), e.g. {EXAMPLE}"
    args = {k: v for k, v in spec.items() if k != "type"}
    if any(isinstance(args.get(side), str) for side in ("low", "high")):
        return f"{name} has a string bound ({args}): YAML reads 1e-3 as a string, write 1.0e-3"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # Optuna only warns of a choice it cannot store
            DISTRIBUTIONS[kind](**args)
    except (TypeError, ValueError, UserWarning) as err:
        return f"{name} ({kind}) is refused by Optuna: {str(err).rstrip('.')}"
    return None


def nest(dotted: dict[str, Any]) -> dict:
    """{'a.b.c': 1} -> {'a': {'b': {'c': 1}}}: the YAML overlay that `--a.b.c 1` means on the command line."""
    tree: dict = {}
    for key, value in dotted.items():
        node = tree
        for part in key.split(".")[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"Sweep keys clash: '{key}' goes below a key that has a value of its own.")
        node[key.split(".")[-1]] = value
    return tree


def base_tree(configs: list[str], *overlays: dict) -> dict:
    def merge(base: dict, overlay: dict) -> dict:
        both = {k for k, v in overlay.items() if isinstance(v, dict) and isinstance(base.get(k), dict)}
        return {**base, **overlay, **{k: merge(base[k], overlay[k]) for k in both}}

    tree: dict = {}
    for document in [*(yaml.safe_load(Path(c).read_text()) or {} for c in configs), *overlays]:
        tree = merge(tree, document)
    return tree


def monitor_of(configs: list[str]) -> tuple[str, str]:
    """The first ModelCheckpoint's monitor and mode in the base configs (what checkpoint selection uses)."""
    for callback in (base_tree(configs).get("trainer") or {}).get("callbacks") or []:
        init = (callback.get("init_args") or {}) if isinstance(callback, dict) else {}
        if init.get("monitor") and str(callback.get("class_path")).endswith("Checkpoint"):
            return init["monitor"], init.get("mode", "min")
    raise ConfigError("No ModelCheckpoint with a `monitor` in the base config: set the sweep file's metric.")


def base_values(space: SweepSpace, configs: list[str]) -> dict[str, Any]:
    """The base configs' own value of each parameter they spell out and the range holds (the first trial's)."""
    tree, values = base_tree(configs, nest(space.fixed)), {}
    for key, spec in space.params.items():
        node: Any = tree
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            continue
        if node in spec["choices"] if "choices" in spec else spec["low"] <= node <= spec["high"]:
            values[key] = node
    return values

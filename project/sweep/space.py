"""The sweep file (configs/sweep/*.yaml): `params` and `fixed` name the training CLI's dotted keys; a parameter
holds the arguments of Optuna's `suggest_<type>`, checked by building its Optuna distribution."""

import copy
import importlib
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import optuna
import yaml
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from project.errors import ConfigError

DISTRIBUTIONS = {"float": FloatDistribution, "int": IntDistribution, "categorical": CategoricalDistribution}
NO_PRUNER = {"class_path": "optuna.pruners.NopPruner"}
EXAMPLE = "{type: float, low: 1.0e-4, high: 1.0e-2, log: true} or {type: categorical, choices: [32, 64]}"


@dataclass
class SweepSpace:
    name: str
    n_trials: int = 20
    metric: str | None = None  # None: the base config's checkpoint monitor, and its mode
    direction: str | None = None
    enqueue_base: bool = True
    sampler: dict | None = None
    pruner: dict | None = None
    fixed: dict[str, Any] = field(default_factory=dict)
    params: dict[str, dict] = field(default_factory=dict)

    def sample(self, trial) -> dict[str, Any]:
        return {k: getattr(trial, f"suggest_{s['type']}")(k, **args(s)) for k, s in self.params.items()}

    def build_sampler(self, seed_offset: int = 0):
        spec = copy.deepcopy(self.sampler or {"class_path": "optuna.samplers.TPESampler"})
        init = spec.setdefault("init_args", {}) or {}
        if init.get("seed") is not None:  # each worker its own draws
            init["seed"] = int(init["seed"]) + seed_offset
        return instantiate(spec, "sampler")


def args(spec: dict) -> dict:
    return {k: v for k, v in spec.items() if k != "type"}


def instantiate(spec: dict, what: str):
    """{class_path: optuna.pruners.MedianPruner, init_args: {...}} -> the object, as LightningCLI builds them."""
    module, _, name = str(spec.get("class_path")).rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)(**(spec.get("init_args") or {}))
    except (ImportError, AttributeError, ValueError, TypeError) as err:
        raise ConfigError(
            f"The sweep file's {what} '{spec.get('class_path')}' cannot be built: {err}."
        ) from err


def load_space(path: str | Path) -> SweepSpace:
    """The parsed sweep file, or one ConfigError that names every problem."""
    path, keys = Path(path), [f.name for f in fields(SweepSpace)]
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as err:  # --space configs/sweep/<name>.yaml
        raise ConfigError(f"Sweep file {path} cannot be read: {' '.join(str(err).split())}") from err
    if not isinstance(raw, dict) or set(raw) - set(keys):
        raise ConfigError(f"{path}: a sweep file is a mapping with the keys {', '.join(keys)}.")
    space = SweepSpace(**{"name": path.stem, **{k: v for k, v in raw.items() if v is not None}})
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
    space.build_sampler()
    instantiate(space.pruner or NO_PRUNER, "pruner")
    return space


def unchangeable(space: SweepSpace, study) -> list[str]:
    """The searched keys whose new range Optuna cannot continue from the study's trials (a categorical's choices)."""
    new, found = {k: DISTRIBUTIONS[s["type"]](**args(s)) for k, s in space.params.items()}, []
    for key, old in {(k, d) for t in study.get_trials(deepcopy=False) for k, d in t.distributions.items()}:
        try:
            optuna.distributions.check_distribution_compatibility(old, new.get(key, old))
        except ValueError:
            found.append(f"'{key}' (the study's {old}, the sweep file's {new[key]})")
    return found


def param_problem(key: str, spec: Any) -> str | None:
    name, kind = f"parameter '{key}'", spec.get("type") if isinstance(spec, dict) else spec
    if kind not in DISTRIBUTIONS:
        return f"{name} has type {kind!r}; it needs a type ({', '.join(DISTRIBUTIONS)}), e.g. {EXAMPLE}"
    if any(isinstance(spec.get(side), str) for side in ("low", "high")):
        return f"{name} has a string bound ({args(spec)}): YAML reads 1e-3 as a string, write 1.0e-3"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # Optuna only warns of a choice it cannot store
            DISTRIBUTIONS[kind](**args(spec))
    except (TypeError, ValueError, UserWarning) as err:
        return f"{name} ({kind}) is refused by Optuna: {str(err).rstrip('.')}"
    return None

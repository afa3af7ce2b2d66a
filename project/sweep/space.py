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
    """Parse and check a sweep file: every problem found is named in one ConfigError paragraph, with its fix."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"Sweep file '{path}' not found. Pass one with --space, e.g. configs/sweep/digits.yaml."
        )
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {' '.join(str(err).split())}") from err
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a sweep file is a mapping with the keys {', '.join(TOP_KEYS)}.")
    problems = []
    unknown = set(raw) - set(TOP_KEYS)
    if unknown:
        problems.append(f"unknown key(s) {sorted(unknown)}; a sweep file has {', '.join(TOP_KEYS)}")
    params = raw.get("params") or {}
    fixed = raw.get("fixed") or {}
    if not isinstance(params, dict) or not params:
        problems.append(
            "`params` is empty; add at least one dotted key with a range, e.g. "
            "model.init_args.optimizer.init_args.lr: {type: float, low: 1.0e-4, high: 1.0e-2, log: true}"
        )
        params = {}
    if not isinstance(fixed, dict):
        problems.append("`fixed` must map dotted keys to values, e.g. trainer.max_epochs: 5")
        fixed = {}
    problems += [p for key, spec in params.items() for p in param_problems(key, spec)]
    problems += [
        f"'{key}' is both searched (params) and fixed: keep it in one of them"
        for key in set(params) & set(fixed)
    ]
    direction = raw.get("direction")
    if direction not in (None, "minimize", "maximize"):
        problems.append(f"direction '{direction}' must be minimize, maximize or null (the monitor's mode)")
    n_trials = raw.get("n_trials")
    if n_trials is not None and (isinstance(n_trials, bool) or not isinstance(n_trials, int) or n_trials < 1):
        problems.append(f"n_trials {n_trials!r} must be a whole number of at least 1")
    if raw.get("metric") is not None and not isinstance(raw.get("metric"), str):
        problems.append(f"metric {raw.get('metric')!r} must be a logged metric's name, e.g. val/loss")
    space = SweepSpace(
        name=str(raw.get("name") or path.stem),
        n_trials=n_trials
        if isinstance(n_trials, int) and not isinstance(n_trials, bool) and n_trials > 0
        else 20,
        params=params,
        fixed=dict(fixed),
        metric=raw.get("metric"),
        direction=direction,
        enqueue_base=bool(raw.get("enqueue_base", True)),
        sampler=raw.get("sampler"),
        pruner=raw.get("pruner"),
    )
    if not problems:
        for build in (space.build_sampler, space.build_pruner):
            try:
                build()
            except ConfigError as err:
                problems.append(str(err).rstrip("."))
        try:
            nest({**space.fixed, **space.params})
        except ConfigError as err:
            problems.append(str(err).rstrip("."))
    if problems:
        raise ConfigError(f"{path}: " + "; ".join(problems) + ". Nothing was run.")
    return space


EXAMPLE = "{type: float, low: 1.0e-4, high: 1.0e-2, log: true} or {type: categorical, choices: [32, 64]}"
SPEC_KEYS = {"float": {"type", "low", "high", "log", "step"}, "int": {"type", "low", "high", "log", "step"}}
SPEC_KEYS["categorical"] = {"type", "choices"}


def param_problems(key: str, spec: Any) -> list[str]:
    """What is wrong with one parameter's range (Optuna would refuse it in every trial, or sample nonsense)."""
    name = f"parameter '{key}'"
    if not isinstance(spec, dict) or spec.get("type") not in KINDS:
        got = spec.get("type") if isinstance(spec, dict) else spec
        return [f"{name} has type {got!r}; it needs a type ({', '.join(KINDS)}), e.g. {EXAMPLE}"]
    kind = spec["type"]
    unknown = set(spec) - SPEC_KEYS[kind]
    if unknown:
        return [
            f"{name} ({kind}) has unknown field(s) {sorted(unknown)}; it takes {', '.join(sorted(SPEC_KEYS[kind]))}"
        ]
    if kind == "categorical":
        choices = spec.get("choices")
        if not isinstance(choices, list) or not choices:
            return [f"categorical {name} needs a non-empty `choices` list, e.g. choices: [32, 64]"]
        odd = [c for c in choices if c is not None and not isinstance(c, (bool, int, float, str))]
        if odd:
            return [
                f"categorical {name} has choice(s) {odd} that are not a number, string, bool or null (Optuna "
                "stores only those): put a class path string, or move the mapping to a config overlay"
            ]
        return []
    low, high = spec.get("low"), spec.get("high")
    number = (int,) if kind == "int" else (int, float)
    for side, value in (("low", low), ("high", high)):
        if isinstance(value, bool) or not isinstance(value, number):
            hint = " (YAML reads 1e-3 as a string: write 1.0e-3)" if isinstance(value, str) else ""
            return [f"{kind} {name} needs a numeric `{side}`, got {value!r}{hint}, e.g. {EXAMPLE}"]
    if low >= high:
        return [
            f"{name} has low {low} >= high {high}: give low < high (a single value belongs under `fixed:`)"
        ]
    log, step = spec.get("log", False), spec.get("step")
    if log not in (True, False):
        return [f"{name} has log {log!r}; log is true or false"]
    if log and low <= 0:
        return [
            f"{name} has log: true with low {low}: a log scale needs low > 0 (e.g. low: {high / 1000:g}), "
            "or set log: false"
        ]
    if step is not None:
        if log:
            return [f"{name} has both log: true and a step; Optuna takes one of them: drop `step` or `log`"]
        if isinstance(step, bool) or not isinstance(step, number) or step <= 0:
            return [f"{name} has step {step!r}; a step is a positive {kind}"]
    return []


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

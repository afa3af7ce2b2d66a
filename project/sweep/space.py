"""The sweep file (configs/sweep/*.yaml): what a sweep searches, with which sampler and pruner, for how long.

Keys of `params` and `fixed` are the training CLI's dotted keys (`model.init_args.optimizer.init_args.lr`, as in
`python -m project fit --model.init_args.optimizer.init_args.lr 0.01`); a trial's config is those keys as one YAML
overlay on the base config, so a trial is `make train` with a second `--config`. A parameter is the arguments of
Optuna's `suggest_<type>` (low, high, log, step; choices), checked by building its Optuna distribution.
"""

import copy
import importlib
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from project.errors import ConfigError

DISTRIBUTIONS = {"float": FloatDistribution, "int": IntDistribution, "categorical": CategoricalDistribution}
TOP_KEYS = ("name", "n_trials", "metric", "direction", "enqueue_base", "sampler", "pruner", "fixed", "params")
EXAMPLE = "{type: float, low: 1.0e-4, high: 1.0e-2, log: true} or {type: categorical, choices: [32, 64]}"


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
        """One value per parameter from an Optuna trial, keyed by the dotted CLI key."""
        return {k: getattr(trial, f"suggest_{s['type']}")(k, **arguments(s)) for k, s in self.params.items()}

    def build_sampler(self, seed_offset: int = 0):
        spec = copy.deepcopy(self.sampler or {"class_path": "optuna.samplers.TPESampler"})
        init = spec.setdefault("init_args", {}) or {}
        if init.get("seed") is not None:  # each worker draws its own numbers (same seed: same draws)
            init["seed"] = int(init["seed"]) + seed_offset
        return instantiate(spec, "sampler")

    def build_pruner(self):
        return instantiate(self.pruner or {"class_path": "optuna.pruners.NopPruner"}, "pruner")


def arguments(spec: dict) -> dict:
    return {k: v for k, v in spec.items() if k != "type"}


def instantiate(spec: dict, what: str):
    """{class_path: optuna.pruners.MedianPruner, init_args: {...}} -> the object (as LightningCLI configs do)."""
    path = spec.get("class_path", "")
    module_name, _, class_name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), class_name)(**(spec.get("init_args") or {}))
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
    params, fixed, n_trials = raw.get("params") or {}, raw.get("fixed") or {}, raw.get("n_trials")
    good_n = isinstance(n_trials, int) and not isinstance(n_trials, bool) and n_trials > 0
    unknown = sorted(set(raw) - set(TOP_KEYS))
    problems = [
        text
        for ok, text in (
            (not unknown, f"unknown key(s) {unknown}; a sweep file has {', '.join(TOP_KEYS)}"),
            (
                params and isinstance(params, dict),
                f"`params` is empty; add a dotted key with a range, e.g. {EXAMPLE}",
            ),
            (isinstance(fixed, dict), "`fixed` must map dotted keys to values, e.g. trainer.max_epochs: 5"),
            (
                raw.get("direction") in (None, "minimize", "maximize"),
                "direction must be minimize, maximize or null",
            ),
            (n_trials is None or good_n, f"n_trials {n_trials!r} must be a whole number of at least 1"),
            (
                isinstance(raw.get("metric"), (str, type(None))),
                "metric must be a logged metric's name, e.g. val/loss",
            ),
        )
        if not ok
    ]
    params, fixed = (params if isinstance(params, dict) else {}), (fixed if isinstance(fixed, dict) else {})
    problems += [p for p in (param_problem(key, spec) for key, spec in params.items()) if p]
    problems += [
        f"'{k}' is both searched (params) and fixed: keep it in one" for k in set(params) & set(fixed)
    ]
    if problems:
        raise ConfigError(f"{path}: " + "; ".join(problems) + ". Nothing was run.")
    kept = {k: raw.get(k) for k in ("metric", "direction", "sampler", "pruner")}
    space = SweepSpace(str(raw.get("name") or path.stem), n_trials or 20, params, dict(fixed), **kept)
    space.enqueue_base = bool(raw.get("enqueue_base", True))
    space.build_sampler(), space.build_pruner()  # a class path that does not build: its own ConfigError
    return space


def param_problem(key: str, spec: Any) -> str | None:
    """What is wrong with one parameter's range (Optuna would refuse it in every trial, or sample nonsense)."""
    name = f"parameter '{key}'"
    kind = spec.get("type") if isinstance(spec, dict) else spec
    if kind not in DISTRIBUTIONS:
        return f"{name} has type {kind!r}; it needs a type ({', '.join(DISTRIBUTIONS)}), e.g. {EXAMPLE}"
    args = arguments(spec)
    if any(isinstance(args.get(side), str) for side in ("low", "high")):
        return f"{name} has a string bound ({args}): YAML reads 1e-3 as a string, write 1.0e-3"
    if kind != "categorical" and args.get("low") is not None and args.get("low") == args.get("high"):
        return f"{name} has low = high = {args['low']}: a single value belongs under `fixed:`"
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
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"Sweep keys clash: '{key}' goes below a key that has a value of its own.")
        node[leaf] = value
    return tree


def merge(base: dict, overlay: dict) -> dict:
    """Deep merge of YAML mappings, the later one winning (how a second --config overrides the first)."""
    out = dict(base)
    for key, value in overlay.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = merge(out[key], value) if both else value
    return out


def base_tree(configs: list[str], *overlays: dict) -> dict:
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
    raise ConfigError(
        "No ModelCheckpoint with a `monitor` in the base config: set `metric` and `direction` in the sweep file."
    )


def base_values(space: SweepSpace, configs: list[str]) -> dict[str, Any]:
    """The base configs' own value of each parameter they spell out and the range holds (the first trial's)."""
    tree, values = base_tree(configs, nest(space.fixed)), {}
    for key, spec in space.params.items():
        node: Any = tree
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None and (
            node in spec["choices"] if spec["type"] == "categorical" else spec["low"] <= node <= spec["high"]
        ):
            values[key] = node
    return values

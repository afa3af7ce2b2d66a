"""Before the first trial: every key and value, read by the training CLI's own parser, and the metric, found by a
one-batch dry run. Otherwise each mistake would fail every trial in turn."""

import difflib
import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import yaml
from lightning.pytorch.callbacks import Callback

from project.atomic import write_text_atomic
from project.errors import ConfigError
from project.sweep.space import SweepSpace
from project.sweep.worker import fit_command, last_lines


def check_inputs(path, space: SweepSpace, configs: list[str]) -> tuple[str, str, dict]:
    """The metric, its direction and the base config's value of each parameter in range (the first trial's)."""
    from project.doctor import training_config

    base, where = [arg for config in configs for arg in ("--config", config)], f"sweep {path}"
    with tempfile.TemporaryDirectory(prefix="sweep-check-") as tmp:
        first = check_keys(Path(tmp), base, space, where)
        write_text_atomic(Path(tmp, "fixed.yaml"), yaml.safe_dump(space.fixed))
        tree = training_config([*base, "--config", str(Path(tmp, "fixed.yaml"))])
        values = {k: lookup(tree, k) for k in space.params}
        values = {k: v for k, v in values.items() if in_range(v, space.params[k])}
        names = reported_metrics(Path(tmp), configs, {**space.fixed, **first, **values})
    checkpoint = [c.get("init_args") or {} for c in tree["trainer"].get("callbacks") or []]
    checkpoint = next((c for c in checkpoint if c.get("monitor") and "mode" in c), {})  # the ModelCheckpoint
    monitor = tree.get("monitor") or checkpoint.get("monitor")
    mode = tree.get("mode") or checkpoint.get("mode") or "min"
    metric, direction = space.metric or monitor, space.direction or f"{mode}imize"  # min -> minimize
    if metric not in names:
        close = difflib.get_close_matches(str(metric), names, n=1, cutoff=0.5)
        raise ConfigError(
            f"{where}: metric '{metric}' is not one a trial reports. After each validation a trial of this config "
            f"logs {', '.join(names) or 'nothing'} (found by a one-batch dry run).{close and f' Did you mean {close[0]!r}?'} Set `metric:` to one of them "
            f"with its `direction:`, or null for the checkpoint monitor ({monitor}). Nothing was run."
        )
    return metric, direction, values if space.enqueue_base else {}


def lookup(tree: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def in_range(value: Any, spec: dict) -> bool:
    if "choices" in spec:
        return value in spec["choices"]
    return isinstance(value, int | float) and spec["low"] <= value <= spec["high"]


def check_keys(tmp: Path, base: list[str], space: SweepSpace, where: str) -> dict:
    """Every key the training config lacks, or else the first value it refuses; the first probe's values."""
    from jsonargparse import ArgumentError

    from project.doctor import training_config
    from project.parse_errors import explain

    tree, keys, problems = training_config(base), {**space.fixed, **space.params}, []
    for key in keys:  # a key below a class that another key sets is checked by the parse below
        if (close := nearest_key(tree, key)) is not None and not any(key.startswith(f"{k}.") for k in keys):
            problems.append(
                f"'{key}' is no key of the training config{close and f' (did you mean {close!r}?)'}"
            )
    if problems:
        raise ConfigError(
            f"{where}: {'; '.join(problems)}. Every key: python -m project fit --help. Nothing was run."
        )
    ends = {k: s.get("choices") or [s["low"], s["high"]] for k, s in space.params.items()}
    probes = [{k: v[i % len(v)] for k, v in ends.items()} for i in range(max(map(len, ends.values())))]
    for probe in probes:  # together they visit every bound and every choice
        write_text_atomic(tmp / "probe.yaml", yaml.safe_dump({**space.fixed, **probe}))
        try:
            training_config([*base, "--config", str(tmp / "probe.yaml")])
        except (ArgumentError, ConfigError) as err:
            said = explain(str(err), [f"--{k}={v}" for k, v in {**space.fixed, **probe}.items()])
            said = " ".join(said.split()).split(" The accepted keys")[0].split(" Every key:")[0]
            raise ConfigError(f"{where}: with {probe}: {said} Nothing was run.") from None
    return probes[0]


def nearest_key(tree: dict, dotted: str) -> str | None:
    """None for a key of the parsed config, else the nearest key there ('' for none)."""
    node, found = tree, []
    for part in dotted.split("."):
        keys = list(node) if isinstance(node, dict) else []
        if not (close := [part] if part in keys else difflib.get_close_matches(part, keys, n=1, cutoff=0.6)):
            return ""
        found.append(close[0])
        node = node[close[0]]
    return None if ".".join(found) == dotted else ".".join(found)


class ReportedMetrics(Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking and not Path(self.path).exists():
            write_text_atomic(self.path, json.dumps(sorted(trainer.callback_metrics)))


def reported_metrics(tmp: Path, configs: list[str], overlay: dict) -> list[str]:
    names, config, log = tmp / "metrics.json", tmp / "check.yaml", tmp / "console.log"
    record = {"class_path": f"{__name__}.ReportedMetrics", "init_args": {"path": str(names)}}
    dry = {"fast_dev_run": 1, "devices": 1, "num_nodes": 1, "strategy": "auto", "enable_progress_bar": False}
    dry = {f"trainer.{k}": v for k, v in dry.items()} | {"trainer.callbacks+": [record]}
    write_text_atomic(config, yaml.safe_dump({**overlay, **dry, "test_after_fit": False}))
    with open(log, "wb") as out:
        code = subprocess.run(fit_command(configs, config, tmp / "run"), stdout=out, stderr=out).returncode
    if code != 0 or not names.exists():
        raise ConfigError(
            f"a one-batch dry run of the trial config (fast_dev_run) failed, so every trial would: {last_lines(log)} "
            "To see it all: python -m project fit with the base configs, --trainer.fast_dev_run 1 and the sweep's "
            "fixed keys and values as flags. Nothing was run."
        )
    return json.loads(names.read_text())

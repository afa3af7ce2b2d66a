"""Before the first trial: every key and value, read by the training CLI's own parser, and the metric, found by a
one-batch dry run. Otherwise each mistake would fail every trial in turn."""

import difflib
import json
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import yaml
from lightning.pytorch.callbacks import Callback

from project.atomic import write_text_atomic
from project.errors import ConfigError
from project.sweep.space import SweepSpace, nest
from project.sweep.worker import fit_command, last_lines


def check_inputs(path, space: SweepSpace, configs: list[str]) -> tuple[str, str, dict]:
    """The metric, its direction and the base config's value of each parameter in range (the first trial's)."""
    from project.doctor import training_config

    base, where = [arg for config in configs for arg in ("--config", config)], f"sweep {path}"
    with tempfile.TemporaryDirectory(prefix="sweep-check-") as tmp:
        first = check_keys(Path(tmp), base, space, where)
        write_text_atomic(Path(tmp, "fixed.yaml"), yaml.safe_dump(nest(space.fixed)))
        tree = training_config([*base, "--config", str(Path(tmp, "fixed.yaml"))])
        values = {k: lookup(tree, k) for k in space.params}
        values = {k: v for k, v in values.items() if in_range(v, space.params[k])}
        names = reported_metrics(Path(tmp), configs, {**space.fixed, **first, **values})
    checkpoint = [c.get("init_args") or {} for c in tree["trainer"].get("callbacks") or []]
    checkpoint = next((c for c in checkpoint if c.get("monitor") and "mode" in c), {})  # the ModelCheckpoint
    monitor, mode = (
        tree.get("monitor") or checkpoint.get("monitor"),
        tree.get("mode") or checkpoint.get("mode"),
    )
    metric, direction = (
        space.metric or monitor,
        space.direction or ("maximize" if mode == "max" else "minimize"),
    )
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
    """Every key or value the training CLI refuses, in one ConfigError; else the first probe's values."""
    from jsonargparse import ArgumentError

    from project.doctor import training_config
    from project.parse_errors import explain

    source = {k: f"`params:` key '{k}'" for k in space.params} | {
        k: f"`fixed:` key '{k}'" for k in space.fixed
    }
    ends = {k: s.get("choices") or [s["low"], s["high"]] for k, s in space.params.items()}
    probes = [{k: v[i % len(v)] for k, v in ends.items()} for i in range(max(map(len, ends.values())))]
    problems, tree = {}, None
    for probe in probes:  # together they visit every bound and every choice
        while "?" not in problems:  # a refused key is left out and the rest parsed again, to name them all
            live = {k: v for k, v in {**space.fixed, **probe}.items() if k not in problems}
            write_text_atomic(tmp / "probe.yaml", yaml.safe_dump(nest(live)))
            try:
                tree = training_config([*base, "--config", str(tmp / "probe.yaml")])
                break
            except (ArgumentError, ConfigError) as err:
                message, key = str(err), culprit(str(err), live)
            if key is None:  # no key to blame: the parser's words, shortened
                problems["?"] = " ".join(explain(message, [f"--{k}={v}" for k, v in live.items()]).split())
            elif "not accept" in message:  # "does not accept option 'a.b'", "Option 'b' is not accepted"
                close = closest_key(tree or training_config(base), key)
                problems[key] = f"{source[key]} is no key of the training config"
                problems[key] += f" (did you mean '{close}'?)" if close else ""
            else:
                reason = " ".join(explain(message, [f"--{key}={live[key]}"]).split())
                reason = reason.split(" The accepted keys and their types")[0]
                problems[key] = f"{source[key]} = {live[key]!r} is refused by the training CLI: {reason}"
    if problems:
        text = "; ".join(problems.values())
        raise ConfigError(
            f"{where}: {text}{' ' if text.endswith(('?', '.')) else '. '}Every key and its type: python -m project "
            "fit --help (the same dotted keys as on the command line). Nothing was run."
        )
    return probes[0]


def culprit(message: str, values: dict[str, Any]) -> str | None:
    """The overlay key a jsonargparse message is about: the innermost key it names, else a value it quotes."""
    for name in reversed(re.findall(r"(?:[Oo]ption '|Parser key \")([\w.]+)['\"]", message)):
        for key in values:
            if key == name or key.endswith(f".{name}"):
                return key
    return next((k for k, v in values.items() if isinstance(v, str) and v and v in message), None)


def closest_key(tree: dict, dotted: str) -> str | None:
    """The existing dotted key nearest to `dotted`, part by part ('trainer.max_epoch' -> 'trainer.max_epochs')."""
    node, found = tree, []
    for part in dotted.split("."):
        close = difflib.get_close_matches(part, list(node), n=1, cutoff=0.6) if isinstance(node, dict) else []
        if not close:
            return None
        found.append(close[0])
        node = node[close[0]]
    return ".".join(found) if ".".join(found) != dotted else None


class ReportedMetrics(Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking and not Path(self.path).exists():
            write_text_atomic(self.path, json.dumps(sorted(trainer.callback_metrics)))


def reported_metrics(tmp: Path, configs: list[str], overlay: dict) -> list[str]:
    names, config, log = tmp / "metrics.json", tmp / "check.yaml", tmp / "console.log"
    tree = nest(overlay)
    record = {"class_path": f"{__name__}.ReportedMetrics", "init_args": {"path": str(names)}}
    dry = {"fast_dev_run": 1, "devices": 1, "num_nodes": 1, "strategy": "auto", "enable_progress_bar": False}
    tree.setdefault("trainer", {}).update(dry, **{"callbacks+": [record]})
    write_text_atomic(config, yaml.safe_dump({**tree, "test_after_fit": False}, sort_keys=False))
    with open(log, "wb") as out:
        code = subprocess.run(fit_command(configs, config, tmp / "run"), stdout=out, stderr=out).returncode
    if code != 0 or not names.exists():
        raise ConfigError(
            f"a one-batch dry run of the trial config (fast_dev_run) failed, so every trial would: {last_lines(log)} "
            "To see it all: python -m project fit with the base configs, --trainer.fast_dev_run 1 and the sweep's "
            "fixed keys and values as flags. Nothing was run."
        )
    return json.loads(names.read_text())

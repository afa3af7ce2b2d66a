"""Before the first trial: the sweep's keys, values and metric, checked by the training CLI and module themselves.

A misspelled key, a refused value or a metric no trial reports would otherwise fail every trial in turn (or train
all of them first). The keys and values: the CLI's own parser reads the base configs plus one overlay per probe.
The metric: a fast_dev_run of the trial config, its own process like a trial, records what the module logs.
"""

import difflib
import json
import re
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from lightning.pytorch.callbacks import Callback

from project.atomic import write_text_atomic
from project.errors import ConfigError
from project.sweep.space import SweepSpace, base_values, nest
from project.sweep.worker import fit_command, last_lines


def check_inputs(path, space: SweepSpace, configs: list[str], flags: dict, metric: str, monitor: str) -> None:
    start, where = time.monotonic(), f"sweep {path}"
    with tempfile.TemporaryDirectory(prefix="sweep-check-") as tmp:
        values = check_keys(Path(tmp), configs, space, flags, where)
        names = reported_metrics(Path(tmp), configs, {**space.fixed, **flags, **values})
    if metric not in names:
        close = difflib.get_close_matches(metric, names, n=1, cutoff=0.5)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ConfigError(
            f"{where}: metric '{metric}' is not one a trial reports. After each validation a trial of this config "
            f"logs {', '.join(names) or 'nothing'} (found by a one-batch dry run).{hint} Set `metric:` to one of "
            f"them with its `direction:`, or null for the checkpoint monitor ({monitor}). Nothing was run."
        )
    print(f"Checked in {time.monotonic() - start:.0f} s: every key and value parses; {metric} is logged.")


def probes(space: SweepSpace) -> list[dict[str, Any]]:
    """Values of the searched keys that together visit every bound and every choice."""
    ends = {k: s.get("choices") or [s["low"], s["high"]] for k, s in space.params.items()}
    return [{k: v[i % len(v)] for k, v in ends.items()} for i in range(max(map(len, ends.values())))]


def check_keys(tmp: Path, configs: list[str], space: SweepSpace, flags: dict, where: str) -> dict:
    """Raise a ConfigError naming every fixed, flag or searched key or value the training CLI refuses; return the
    first trial's values (the base config's where they are in range) for the dry run."""
    from jsonargparse import ArgumentError

    from project.doctor import training_config
    from project.parse_errors import explain

    source = {k: f"`params:` key '{k}'" for k in space.params}
    source |= {k: f"`fixed:` key '{k}'" for k in space.fixed} | {k: f"trial flag '--{k}'" for k in flags}
    base, problems, tree = [arg for config in configs for arg in ("--config", config)], {}, None
    for probe in probes(space):
        while "?" not in problems:  # each refused key is left out and the rest parsed again, to name them all
            live = {k: v for k, v in {**space.fixed, **flags, **probe}.items() if k not in problems}
            write_text_atomic(tmp / "probe.yaml", yaml.safe_dump(nest(live)))  # the CLI reads --config files
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
    return {**probes(space)[0], **base_values(space, configs)}


def culprit(message: str, values: dict[str, Any]) -> str | None:
    """The overlay key a jsonargparse message is about (the innermost key it names, else a value it quotes)."""
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
    """Writes the names in trainer.callback_metrics after the first validation (not the sanity check) to `path`."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking and not Path(self.path).exists():
            write_text_atomic(self.path, json.dumps(sorted(trainer.callback_metrics)))


def reported_metrics(tmp: Path, configs: list[str], overlay: dict) -> list[str]:
    """The metric names a trial reports after each validation (one batch, one device, no test after fit)."""
    names, config, log = tmp / "metrics.json", tmp / "check.yaml", tmp / "console.log"
    tree = nest(overlay)
    record = {"class_path": f"{__name__}.ReportedMetrics", "init_args": {"path": str(names)}}
    dry = {"fast_dev_run": 1, "devices": 1, "num_nodes": 1, "strategy": "auto", "enable_progress_bar": False}
    tree.setdefault("trainer", {}).update(dry, **{"callbacks+": [record]})
    write_text_atomic(config, yaml.safe_dump({**tree, "test_after_fit": False}, sort_keys=False))
    with open(log, "wb") as out:
        code = subprocess.run(fit_command(configs, config, tmp / "run"), stdout=out, stderr=out).returncode
    if code != 0 or not names.exists():
        shown = " ".join(["python -m project fit", *(a for c in configs for a in ("--config", c))])
        raise ConfigError(
            f"a one-batch dry run of the trial config (fast_dev_run) failed, so every trial would: {last_lines(log)} "
            f"To see it all: {shown} --trainer.fast_dev_run 1 with the sweep's fixed keys and values as flags. "
            "Nothing was run."
        )
    return json.loads(names.read_text())

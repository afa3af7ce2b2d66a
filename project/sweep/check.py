"""Before the first trial: the sweep's keys, values and metric, checked by the training CLI and module themselves.

A misspelled key, a value the config refuses or a metric no trial reports would otherwise fail every trial of the
sweep, one after another (or train all of them first). Both checks run before the study's storage is opened, so a
refused sweep creates nothing and changes nothing in an existing sweep directory.

- Keys and values (`check_keys`): the CLI's own parser (project.doctor.training_config: it parses, builds nothing)
  reads the base configs plus one YAML overlay per probe: every fixed key and trial flag, and every searched key
  at its low, its high and each of its choices. A refused key is named with its closest existing key.
- The metric (`reported_metrics`): one `python -m project fit` of the trial config with `--trainer.fast_dev_run 1`
  (one training and one validation batch, in a temporary directory, as its own process like a trial) records the
  names in `trainer.callback_metrics` at the end of its validation: what a trial's pruning callback reads after
  every epoch. The module's own logging decides, so no list of names can go stale.
"""

import difflib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml
from lightning.pytorch.callbacks import Callback

from project.atomic import write_text_atomic
from project.errors import ConfigError
from project.sweep.space import SweepSpace, base_values, nest


def probes(space: SweepSpace) -> list[dict[str, Any]]:
    """Values of the searched keys that together visit every bound and every choice (the first: the base config's
    own values where they are in range, as the sweep's first trial)."""
    n = max([2, *(len(s["choices"]) for s in space.params.values() if s["type"] == "categorical")])
    return [
        {
            key: spec["choices"][i % len(spec["choices"])]
            if spec["type"] == "categorical"
            else spec["low" if i % 2 == 0 else "high"]
            for key, spec in space.params.items()
        }
        for i in range(n)
    ]


def check_keys(configs: list[str], space: SweepSpace, flags: dict, where: str) -> tuple[dict[str, Any], dict]:
    """Raise a ConfigError naming every fixed, flag or searched key the training CLI refuses (with the closest key
    it has); return the first probe's values (base values where valid) for the dry run, and the parsed config."""
    from jsonargparse import ArgumentError

    from project.doctor import training_config
    from project.parse_errors import explain

    source = {k: f"`params:` key '{k}'" for k in space.params}
    source |= {k: f"`fixed:` key '{k}'" for k in space.fixed}
    source |= {k: f"trial flag '--{k}'" for k in flags}
    base = [arg for config in configs for arg in ("--config", config)]
    problems: dict[str, str] = {}
    tree: dict | None = None
    for probe in probes(space):
        values = {**space.fixed, **flags, **probe}
        while True:
            live = {k: v for k, v in values.items() if k not in problems}
            try:
                tree = training_config([*base, "--config", yaml.safe_dump(nest(live))])
                break
            except (ArgumentError, ConfigError) as err:
                message = str(err)
                key = culprit(message, live)
                if key is None:  # the parser's words, shortened: no key to blame
                    problems["?"] = " ".join(
                        explain(message, [f"--{k}={v}" for k, v in live.items()]).split()
                    )
                    break
                if re.search(
                    rf"(does not accept option '{re.escape(key)}'|Option '{re.escape(key.split('.')[-1])}' "
                    "is not accepted)",
                    message,
                ):
                    close = closest_key(tree or _parsed_base(base), key)
                    hint = f" (did you mean '{close}'?)" if close else ""
                    problems[key] = f"{source[key]} is no key of the training config{hint}"
                else:
                    reason = explain(message, [f"--{key}={live[key]}"])
                    reason = " ".join(reason.split()).split(" The accepted keys and their types")[0]
                    problems[key] = f"{source[key]} = {live[key]!r} is refused by the training CLI: {reason}"
        if "?" in problems:
            break
    if problems:
        text = "; ".join(problems.values())
        raise ConfigError(
            f"{where}: {text}{' ' if text.endswith(('?', '.')) else '. '}Every key and its type: python -m project "
            "fit --help (the same dotted keys as on the command line). Nothing was run."
        )
    return {**probes(space)[0], **base_values(space, configs)}, tree or {}


def _parsed_base(base: list[str]) -> dict:
    from project.doctor import training_config

    try:
        return training_config(base)
    except Exception:  # noqa: BLE001 - a suggestion is a courtesy; the base config's own error comes elsewhere
        return {}


def culprit(message: str, values: dict[str, Any]) -> str | None:
    """The overlay key a jsonargparse message is about, or None."""
    found = re.search(r"does not accept option '([^']+)'", message)
    if found and found.group(1) in values:
        return found.group(1)
    leaves = [m.group(1) for m in re.finditer(r"(?:Option '|Parser key \")([\w.]+)['\"]", message)]
    for leaf in reversed(leaves):  # the innermost key named
        for key in values:
            if key == leaf or key.endswith(f".{leaf}"):
                if leaf != key.split(".")[0] or key == leaf:
                    return key
    for key, value in values.items():  # a class path or other string value quoted in the message
        if isinstance(value, str) and value and value in message:
            return key
    return None


def closest_key(tree: dict, dotted: str) -> str | None:
    """The existing dotted key nearest to `dotted`, part by part ('trainer.max_epoch' -> 'trainer.max_epochs')."""
    node: Any = tree
    out = []
    for part in dotted.split("."):
        if not isinstance(node, dict):
            return None
        if part not in node:
            close = difflib.get_close_matches(part, [str(k) for k in node], n=1, cutoff=0.6)
            if not close:
                return None
            part = close[0]
        out.append(part)
        node = node[part]
    found = ".".join(out)
    return found if found != dotted else None


class ReportedMetrics(Callback):
    """Writes the names in trainer.callback_metrics after the first validation (not the sanity check) to `path`:
    what a trial's pruning callback can read after every epoch."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking and not Path(self.path).exists():
            write_text_atomic(self.path, json.dumps(sorted(trainer.callback_metrics)))


def reported_metrics(configs: list[str], overlay: dict, threads: str | None) -> list[str]:
    """The metric names a trial reports after each validation: one fast_dev_run of the trial config as its own
    process, on one device, in a temporary directory."""
    from project.sweep.worker import last_lines

    with tempfile.TemporaryDirectory(prefix="sweep-check-") as tmp:
        names_path, config = Path(tmp) / "metrics.json", Path(tmp) / "check.yaml"
        tree = nest(overlay)
        record = {"class_path": f"{__name__}.ReportedMetrics", "init_args": {"path": str(names_path)}}
        tree.setdefault("trainer", {})["callbacks+"] = [record]
        write_text_atomic(config, yaml.safe_dump(tree, sort_keys=False))
        command = [sys.executable, "-m", "project", "fit"]
        command += [arg for c in configs for arg in ("--config", c)] + ["--config", str(config)]
        command += ["--trainer.fast_dev_run", "1", "--trainer.devices", "1", "--trainer.num_nodes", "1"]
        command += ["--trainer.strategy", "auto", "--trainer.enable_progress_bar", "false"]
        command += ["--test_after_fit", "false", "--run_dir", str(Path(tmp) / "run")]
        env = dict(os.environ, **({"OMP_NUM_THREADS": threads} if threads else {}))
        log = Path(tmp) / "console.log"
        with open(log, "wb") as out:
            code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env).returncode
        if code != 0 or not names_path.exists():
            shown = " ".join(a if " " not in a else repr(a) for a in command[1:-2] if not a.startswith(tmp))
            raise ConfigError(
                f"a one-batch dry run of the trial config (fast_dev_run) failed, so every trial would: "
                f"{last_lines(log)} To see it all: python {shown} with the sweep's fixed keys and values as "
                "flags. Nothing was run."
            )
        return json.loads(names_path.read_text())


def writes_csv(config: dict) -> bool:
    """Whether a parsed training config logs to metrics.csv (a CSVLogger, or a subclass, among its loggers)."""
    import pydoc

    from lightning.pytorch.loggers import CSVLogger

    loggers = (config.get("trainer") or {}).get("logger")
    for logger in loggers if isinstance(loggers, list) else [loggers]:
        class_path = logger.get("class_path") if isinstance(logger, dict) else None
        cls = pydoc.locate(class_path) if class_path else None  # the parser has imported it already
        if isinstance(cls, type) and issubclass(cls, CSVLogger):
            return True
    return False


def check_metric(metric: str, monitor: str, names: list[str], writes_csv: bool, where: str) -> None:
    """The metric must be one a trial reports after each validation (pruning reads it then); a metric other than
    the checkpoint monitor is read from metrics.csv at the end, so the config must write that file."""
    if metric not in names:
        close = difflib.get_close_matches(metric, names, n=1, cutoff=0.5)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ConfigError(
            f"{where}: metric '{metric}' is not one a trial reports. After each validation a trial of this config "
            f"logs {', '.join(names) or 'nothing'} (found by a one-batch dry run).{hint} Set `metric:` to one of "
            f"them with its `direction:`, or null for the checkpoint monitor ({monitor}). Nothing was run."
        )
    if metric != monitor and not writes_csv:
        raise ConfigError(
            f"{where}: metric '{metric}' is not the checkpoint monitor ({monitor}), so each trial's value is read "
            "from its metrics.csv, but this config writes none: add a CSVLogger (--config configs/logger/csv.yaml) "
            "or rank by the monitor (metric: null). Nothing was run."
        )

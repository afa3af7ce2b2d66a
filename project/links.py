"""The data decides num_classes, in_channels and input_shape; the module and its model receive them, never typed.

jsonargparse's links write the source's value, None included, over the default and what the user typed: a value
reaches an argument here only when the target takes it, the data module knows it and the user gave none."""

import inspect
import pydoc
from dataclasses import dataclass
from typing import Any

from jsonargparse import ArgumentParser, Namespace

from project.errors import ConfigError

# (the data module's attribute, the argument it fills)
DATA_TO_MODEL = (
    ("num_classes", "model.init_args.num_classes"),
    ("input_shape", "model.init_args.input_shape"),
    ("num_classes", "model.init_args.model.init_args.num_classes"),
    ("in_channels", "model.init_args.model.init_args.in_channels"),
)


@dataclass(frozen=True)
class Link:
    attribute: str  # of the data module
    target: str  # config key
    callable_path: str  # the class or function that takes it
    default: Any  # the argument's default (inspect.Parameter.empty when it has none)

    def value(self, data) -> Any:
        found = getattr(data, self.attribute, None)
        if found is not None:
            return found
        if self.default is inspect.Parameter.empty:
            raise ConfigError(
                f"{self.callable_path} needs `{self.attribute.split('.')[-1]}`, and the data module "
                f"({type(data).__name__}) does not say it (no `{self.attribute}` attribute, or None). Give it: "
                f"--{self.target} <value>."
            )
        return self.default


def plan(config: Namespace, given: set[str] = frozenset()) -> list[Link]:
    """The links that apply to this parsed config (one subcommand's part); `given`: the keys the user set."""
    links = []
    for attribute, target in DATA_TO_MODEL:
        owner, _, name = target.rpartition(".init_args.")
        node = config.get(owner)
        if not isinstance(node, Namespace) or not node.get("class_path"):
            continue
        init = node.get("init_args") or Namespace()
        if name not in init:  # jsonargparse lists the arguments it found (through **kwargs too)
            continue
        if target not in given:  # not the parsed value: a class path change keeps the old class's values
            links.append(Link(attribute, target, node.class_path, parameters(node.class_path).get(name)))
    return links


def given_keys(args: list[str] | dict, config_files: list[str] = ()) -> set[str]:
    """The dotted keys a command sets: its `--key value` flags and the keys of its YAML files (`--config`)."""
    import yaml

    def read(path: str) -> str:
        try:
            return open(path, encoding="utf-8").read()
        except OSError:  # the parser says what is wrong with it
            return ""

    keys, documents = set(), [yaml.safe_load(read(f)) for f in config_files]
    if isinstance(args, dict):
        documents.append(args)
    else:
        for i, arg in enumerate(args):
            if arg in ("--config", "-c") and i + 1 < len(args):  # a file, or the YAML itself
                value = str(args[i + 1])
                documents.append(yaml.safe_load(read(value) if "\n" not in value else value))
            elif arg.startswith("--"):
                keys.add(arg[2:].split("=", 1)[0])
    for document in documents:
        keys |= _flat_keys(document) if isinstance(document, dict) else set()
    return keys


def _flat_keys(node: dict, prefix: str = "") -> set[str]:
    keys = set()
    for key, value in node.items():
        keys.add(prefix + str(key))
        if isinstance(value, dict):
            keys |= _flat_keys(value, f"{prefix}{key}.")
    return keys


def parameters(callable_path: str) -> dict[str, Any]:
    """The arguments of a class (through **kwargs too) or function as the parser reads them, each with its default
    (Parameter.empty when required); {} when it cannot be imported: the parser says why."""
    try:
        target = pydoc.locate(callable_path)
    except pydoc.ErrorDuringImport:
        return {}
    if target is None:
        return {}
    parser = ArgumentParser(exit_on_error=False)
    add = parser.add_class_arguments if isinstance(target, type) else parser.add_function_arguments
    add(target, fail_untyped=False, sub_configs=True)
    found = vars(parser.get_defaults(skip_validation=True))
    signatures = (
        [vars(k).get("__init__") for k in inspect.getmro(target)] if isinstance(target, type) else [target]
    )
    for name in [n for n, default in found.items() if default is None]:  # None, or required (a linked one)
        for function in filter(None, signatures):
            if (parameter := inspect.signature(function).parameters.get(name)) is not None:
                found[name] = parameter.default
                break
    return found

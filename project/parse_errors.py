"""A refusal of jsonargparse in one paragraph with the fix: its message lists every Union alternative it tried, the
useful line in the middle. The cases met most are recognised from that message; any other keeps its lines."""

import difflib
import inspect
import pydoc
import re
import sys
from collections.abc import Sequence

from project.links import parameters

TOP_LEVEL = "config seed_everything trainer model data ckpt_path run_dir test_after_fit".split()
TOP_LEVEL += ["checkpoint_every_n_steps", "monitor", "mode"]
HELP = " Every key: python -m project fit --help."


def explain(message: str, argv: Sequence[str]) -> str:
    for case in (_positional_dataset, _unknown_option, _no_module, _no_attribute, _unknown):
        if text := case(message, argv):
            return text
    noise = ("Does not validate against any", "Subtypes:", "Errors:", "NoneType", "Given value type:")
    lines = [s.strip(" -") for s in message.splitlines() if s.strip() and not any(n in s for n in noise)]
    text = "\n  ".join(lines)
    return f"invalid arguments or config: {text}\nThe accepted keys and their types: python -m project fit --help"


def _closest(word: str, choices: Sequence[str], quote: str = "'") -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" Did you mean {quote}{close[0]}{quote.strip('-')}?" if close else ""


def _flag(argv: Sequence[str], name: str = "", value: str = "") -> str:
    """The flag that set key `name` (or gave `value`) last, as typed; else what a config file named."""
    for before, arg in reversed(list(zip(["", *argv], argv))):
        key, _, given = arg.partition("=")
        if name and key.startswith("--") and (key == f"--{name}" or key.endswith(f".{name}")):
            return key
        if value and value in (given, arg):
            return key if given else f"{before} {value}"
    return name or value


def _unknown_option(message: str, argv: Sequence[str]) -> str | None:
    owners = re.findall(r"Problem with given class_path '([\w.]+)'", message)
    option = re.search(r"Option '([\w.]+)' is not accepted", message)
    if not owners or not option:
        return None
    # A callable argument (the optimizer) names its class in the value given, inside the error of its owner.
    given = re.search(r"is not accepted\. Got value: Namespace\(class_path='([\w.]+)'", message)
    owner, name = given[1] if given else owners[-1], option[1].split(".")[-1]
    # The module passes an optimizer its parameters and a scheduler its optimizer: not config keys.
    params = [p for p in parameters(owner) if not (given and p in ("params", "optimizer"))]
    listed = f" Its arguments: {', '.join(params)}." if params else ""
    return f"{_flag(argv, name)}: {owner} takes no argument '{name}'.{_closest(name, params)}{listed}{HELP}"


def _positional_dataset(message: str, argv: Sequence[str]) -> str | None:
    """A Dataset taking positional arguments only (TensorDataset(*tensors)): a config names every argument."""
    found = re.search(
        r'Parser key "(\w+)":\s*Problem with given class_path \'([\w.]+)\':\s*'
        r"(?:Option '(\w+)' is not accepted|'list' object has no attribute 'keys')",
        message,
    )
    cls = found and pydoc.locate(found[2])
    if not (isinstance(cls, type) and any(k.__name__ == "Dataset" for k in cls.__mro__)):
        return None
    key, path, option = found.groups()
    star = [p.name for p in inspect.signature(cls).parameters.values() if p.kind == p.VAR_POSITIONAL]
    if not star or (option and _closest(option, list(parameters(path)))):
        return None
    flag = _flag(argv, option or key)
    return (
        f"{flag if flag.startswith('--') else key}: {path} takes its arguments by position (*{star[0]}), and a "
        "config gives arguments by name only. Write a function that builds the dataset, annotated to return a "
        "Dataset, and give its import path as the class_path (a function works wherever a class does):\n  "
        f"my_data.py:  def make_dataset(n: int = 100) -> Dataset: return {cls.__name__}(torch.randn(n, 8), "
        f"torch.arange(n) % 2)\n  the config:  {key}: {{class_path: my_data.make_dataset, init_args: {{n: 100}}}}"
    )


def _no_module(message: str, argv: Sequence[str]) -> str | None:
    found = re.search(r"Problem with given class_path '([\w.]+)':\s*No module named '([\w.]+)'", message)
    if not found:
        return None
    path, module = found.groups()
    return (
        f"{_flag(argv, value=path)}: no module named '{module}' on the Python path, so '{path}' cannot be imported. "
        f"If it is your file ({module.replace('.', '/')}.py), run from the folder that holds it or add that folder "
        f"to PYTHONPATH (PYTHONPATH=/path/to/folder make train ARGS=...); check the spelling of '{module}'."
    )


def _no_attribute(message: str, argv: Sequence[str]) -> str | None:
    found = re.search(r"module '([\w.]+)' has no attribute '(\w+)'", message)
    if not found:
        return None
    module, name = found.groups()
    names = [n for n in dir(sys.modules[module]) if not n.startswith("_")] if module in sys.modules else []
    hint = _closest(f"{module}.{name}", [f"{module}.{n}" for n in names], quote="")
    return f"{_flag(argv, value=f'{module}.{name}')}: module '{module}' has no '{name}'.{hint}"


def _unknown(message: str, argv: Sequence[str]) -> str | None:
    found = re.search(r"unrecognized arguments: (\S+)", message)
    if not found:
        return None
    flag = found[1].split("=", 1)[0]
    key = flag.lstrip("-")
    if key.split(".")[0] in ("optimizer", "lr_scheduler"):  # auto_configure_optimizers=False (project/cli.py)
        return (
            f"{flag.split('.')[0]} is Lightning's top-level flag, which would replace the module's "
            "configure_optimizers: its parameter groups (no weight decay on biases and norm layers) and its "
            "warmup-cosine schedule would be dropped silently. Set the module's instead: --model.init_args.optimizer "
            "torch.optim.SGD --model.init_args.optimizer.init_args.lr 0.1 (any torch optimizer), and "
            "--model.init_args.scheduler <class path, or null for a constant lr>."
        )
    trainer = [f"trainer.{p}" for p in parameters("lightning.pytorch.Trainer")]
    choices = trainer if key.startswith("trainer.") else TOP_LEVEL
    return f"{flag}: no such key.{_closest(key, choices, '--')}{HELP}"

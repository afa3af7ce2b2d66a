"""A config or flag the parser refuses, said in one paragraph: what is wrong, the closest match, and the fix.

jsonargparse explains a refused key or class path with every Union alternative it tried, the useful line in the
middle. The cases a person meets most are recognised here from its message and said in one paragraph; anything
else keeps the parser's own lines, shortened (`condense`).
"""

import difflib
import importlib
import inspect
import pydoc
import re
from collections.abc import Sequence

TOP_LEVEL = (
    "config",
    "seed_everything",
    "trainer",
    "model",
    "data",
    "ckpt_path",
    "run_dir",
    "test_after_fit",
)
TOP_LEVEL += ("checkpoint_every_n_steps", "monitor", "mode")


def explain(message: str, argv: Sequence[str]) -> str:
    """One paragraph for a refused argument, with `did you mean` where a close match exists."""
    cases = (_positional_dataset, _unannotated_function, _unknown_option, _missing_module, _missing_attribute)
    for explain_case in (*cases, _unrecognized):
        text = explain_case(message, argv)
        if text:
            return text
    return condense(message)


def condense(message: str) -> str:
    """The parser's lines without the Union alternatives' noise."""
    noise = (
        "Does not validate against any of the Union",
        "Subtypes:",
        "Errors:",
        "NoneType",
        "Given value type:",
    )
    lines = [
        line.strip(" -")
        for line in message.splitlines()
        if line.strip() and not any(n in line for n in noise)
    ]
    return (
        "invalid arguments or config: "
        + "\n  ".join(lines)
        + "\nThe accepted keys and their types: python -m project "
        "fit --help"
    )


def _closest(word: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" Did you mean '{close[0]}'?" if close else ""


def _flag(argv: Sequence[str], name: str) -> str:
    """The command-line flag (or config key) that named `name` last, as the user typed it."""
    for arg in reversed(argv):
        key = arg.split("=", 1)[0]
        if key.startswith("--") and (key == f"--{name}" or key.endswith(f".{name}")):
            return key
    return name


def _unknown_option(message: str, argv: Sequence[str]) -> str | None:
    owners = re.findall(r"Problem with given class_path '([\w.]+)'", message)
    option = re.search(r"Option '([\w.]+)' is not accepted", message)
    if not owners or not option:
        return None
    # A callable argument (the optimizer, the scheduler) names its own class in the value it was given, inside the
    # error of the class that takes it: that inner class is the one without the argument.
    given = re.search(
        r"Option '[\w.]+' is not accepted\. Got value: Namespace\(class_path='([\w.]+)'", message
    )
    owner, name = given.group(1) if given else owners[-1], option.group(1).split(".")[-1]
    params = constructor_parameters(owner)
    if given:  # the module passes an optimizer its parameters and a scheduler its optimizer: not config keys
        params = [p for p in params if p not in ("params", "optimizer")]
    where = _flag(argv, name)
    listed = f" Its arguments: {', '.join(params)}." if params else ""
    return (
        f"{where}: {owner} takes no argument '{name}'.{_closest(name, params)}{listed} Every key: python -m project "
        "fit --help."
    )


def _positional_dataset(message: str, argv: Sequence[str]) -> str | None:
    """A Dataset whose constructor takes positional arguments only (TensorDataset(*tensors)): a config names every
    argument, and a function that builds the dataset takes the class's place."""
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
    if not star or (option and _closest(option, constructor_parameters(path))):
        return None
    flag = _flag(argv, option or key)
    where = flag if flag.startswith("--") else key
    return (
        f"{where}: {path} takes its arguments by position (*{star[0]}), and a config gives arguments by name "
        "only. Write a function that builds the dataset, annotated to return a Dataset, and give its import path "
        "as the class_path (a function works wherever a class does):\n  my_data.py:  def make_dataset(n: int = "
        f"100) -> Dataset: return {cls.__name__}(torch.randn(n, 8), torch.arange(n) % 2)\n  the config:  {key}: "
        "{class_path: my_data.make_dataset, init_args: {n: 100}}"
    )


def _unannotated_function(message: str, argv: Sequence[str]) -> str | None:
    found = re.search(r"Import path ([\w.]+) does not correspond to a subclass of (\w+)", message)
    function = found and pydoc.locate(found[1])
    if not inspect.isfunction(function):
        return None
    path, base = found.groups()
    returns = inspect.signature(function).return_annotation
    said = (
        "has no return annotation"
        if returns is inspect.Signature.empty
        else f"is annotated to return {getattr(returns, '__name__', returns)}"
    )
    return (
        f"{_flag_of_value(argv, path)}: the function {path} {said}. A function takes the place of a {base} class "
        f"only when it says it returns one: def {function.__name__}(...) -> {base}: (with {base} imported in "
        "your file)."
    )


def _missing_module(message: str, argv: Sequence[str]) -> str | None:
    found = re.search(r"Problem with given class_path '([\w.]+)':\s*No module named '([\w.]+)'", message)
    if not found:
        return None
    path, module = found.groups()
    return (
        f"{_flag_of_value(argv, path)}: no module named '{module}' on the Python path, so '{path}' cannot be imported. "
        f"If it is your file ({module.replace('.', '/')}.py), run from the folder that holds it or add that folder "
        f"to PYTHONPATH (PYTHONPATH=/path/to/folder make train ARGS=...); check the spelling of '{module}'."
    )


def _missing_attribute(message: str, argv: Sequence[str]) -> str | None:
    # jsonargparse words it one way for a class ("Problem with given class_path ...: module ... has no attribute")
    # and another for a callable such as the optimizer ("... expects a function or a callable class: module ...").
    found = re.search(r"module '([\w.]+)' has no attribute '(\w+)'", message)
    if not found:
        return None
    module, name = found.groups()
    path = f"{module}.{name}"
    try:
        names = [n for n in dir(importlib.import_module(module)) if not n.startswith("_")]
    except Exception:  # noqa: BLE001 - the suggestion is a courtesy
        names = []
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    hint = f" Did you mean {module}.{close[0]}?" if close else f" It has: {', '.join(names[:20])}."
    return f"{_flag_of_value(argv, path)}: module '{module}' has no '{name}'.{hint}"


def _unrecognized(message: str, argv: Sequence[str]) -> str | None:
    found = re.search(r"unrecognized arguments: (.+)", message)
    if not found:
        return None
    flag = found.group(1).split()[0]
    key = flag.lstrip("-").split("=", 1)[0]
    head, _, rest = key.partition(".")
    if head == "trainer" and rest:
        choices = [f"trainer.{p}" for p in constructor_parameters("lightning.pytorch.Trainer")]
    else:
        choices = list(TOP_LEVEL)
    close = difflib.get_close_matches(key, choices, n=1, cutoff=0.6)
    hint = f" Did you mean --{close[0]}?" if close else ""
    return f"{flag}: no such key.{hint} Every key: python -m project fit --help."


def _flag_of_value(argv: Sequence[str], value: str) -> str:
    """The flag whose value is `value` (a class path), or the value itself when it came from a config file."""
    for i, arg in enumerate(argv):
        if arg.endswith(f"={value}"):
            return arg.split("=", 1)[0]
        if arg == value and i > 0 and argv[i - 1].startswith("--"):
            return f"{argv[i - 1]} {value}"
    return value


def constructor_parameters(class_path: str) -> list[str]:
    """The named arguments of a class's constructor, in order, and of its bases' while it passes them `**kwargs` (as
    the parser reads them); [] when it cannot be imported: the parser says why."""
    try:
        cls = pydoc.locate(class_path)
    except pydoc.ErrorDuringImport:
        return []
    named: dict[str, None] = {}
    for klass in inspect.getmro(cls) if isinstance(cls, type) else ():
        if "__init__" not in vars(klass):
            continue
        try:
            parameters = list(inspect.signature(vars(klass)["__init__"]).parameters.values())[1:]  # not self
        except (ValueError, TypeError):
            break
        named |= dict.fromkeys(p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
        if not any(p.kind == p.VAR_KEYWORD for p in parameters):
            break
    return list(named)

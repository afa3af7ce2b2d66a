"""The one exception type the CLI turns into a readable paragraph instead of a traceback, and how to find it."""

import contextlib
import re
import sys
from collections.abc import Iterator
from typing import TypeVar

E = TypeVar("E", bound=BaseException)


class ConfigError(ValueError):
    """Bad user input (config, data, checkpoint): the message says what is wrong, where, and the fix."""


def find_in_chain(err: BaseException | None, kind: type[E]) -> E | None:
    """The first exception of type `kind` in err's chain of causes (`raise ... from`) and contexts, or None.

    Libraries wrap errors: jsonargparse wraps a ConfigError raised while instantiating a class, torch's zip writer
    turns a full disk's OSError into a RuntimeError.
    """
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, kind):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def user_error_paragraph(err: BaseException) -> str | None:
    """The paragraph to print for an error the user can fix (a ConfigError anywhere in err's chain, running out of
    GPU memory), or None for anything else: a bug, whose traceback must show."""
    torch = sys.modules.get(
        "torch"
    )  # not imported here: a tool that never loaded torch cannot run out of memory
    if torch is not None and isinstance(err, torch.OutOfMemoryError):  # the fix, not a CUDA allocator dump
        first = str(err).strip().splitlines()[0] if str(err).strip() else "CUDA out of memory"
        return (
            f"out of GPU memory ({first[:160]}). Lower the batch size, e.g. --data.init_args.batch_size 32 "
            "(the learning rate may need lowering with it), or use mixed precision: --trainer.precision bf16-mixed. "
            "Resume the run with --ckpt_path last."
        )
    config_error = find_in_chain(err, ConfigError) or nondeterministic_op_error(err)
    return None if config_error is None else str(config_error)


@contextlib.contextmanager
def exit_on_user_error() -> Iterator[None]:
    """Print a user error as one paragraph on stderr and exit with code 2; let every other exception through."""
    try:
        yield
    except Exception as err:
        paragraph = user_error_paragraph(err)
        if paragraph is None:
            where = user_code_frame(err)
            if where is None:  # a bug of the template or a library: its traceback, as Python prints it
                raise
            print(f"\nerror: raised in your code, {where}; its traceback:\n", file=sys.stderr, flush=True)
            sys.excepthook(*sys.exc_info())  # a DDP rank's own hook names the rank
            sys.exit(1)
        print(f"\nerror: {paragraph}\n", file=sys.stderr, flush=True)
        sys.exit(2)


def user_code_frame(err: BaseException) -> str | None:
    """'file:line in function' of the innermost frame outside Python, the installed packages and this package
    (the user's model, collate_fn, dataset), or None. A DataLoader worker's error carries its traceback as text."""
    import sysconfig
    import traceback
    from pathlib import Path

    paths = sysconfig.get_paths()
    library = tuple(str(Path(paths[k]).resolve()) for k in ("stdlib", "platstdlib", "purelib", "platlib"))
    library += (str(Path(__file__).resolve().parent), str(Path(sys.prefix).resolve()))
    frames = [(f.filename, f.lineno, f.name) for f in traceback.extract_tb(err.__traceback__)]
    frames += re.findall(r'File "([^"]+)", line (\d+), in (\S+)', str(err))
    for filename, line, name in reversed(frames):
        if not filename.startswith("<") and not str(Path(filename).resolve()).startswith(library):
            return f"{filename}:{line} in {name}"
    return None


def nondeterministic_op_error(err: BaseException) -> ConfigError | None:
    """torch's RuntimeError for an op without a deterministic kernel (under `deterministic: true`), with the fix."""
    while err is not None:
        found = re.search(r"(\S+) does not have a deterministic implementation", str(err))
        if found:
            return ConfigError(
                f"{found[1]} has no deterministic implementation on this device, and the config asks for one "
                "(trainer.deterministic: true, the default). Run with --trainer.deterministic warn to let it run "
                "nondeterministically (a warning names it; runs may then differ in the last bits), or replace that "
                "op in the model (for AdaptiveAvgPool2d, an input size that divides the output size exactly)."
            )
        err = err.__cause__ or err.__context__
    return None

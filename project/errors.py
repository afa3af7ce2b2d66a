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
    """The first exception of type `kind` among err's causes and contexts (libraries wrap errors)."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, kind):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def user_error_paragraph(err: BaseException) -> str | None:
    """The paragraph for an error the user can fix, or None for a bug, whose traceback must show."""
    torch = sys.modules.get("torch")  # not imported: a tool that never loaded torch cannot run out of memory
    if torch is not None and isinstance(err, torch.OutOfMemoryError):
        first = str(err).strip().splitlines()[0] if str(err).strip() else "CUDA out of memory"
        return (
            f"out of GPU memory ({first[:160]}). Lower the batch size, e.g. --data.init_args.batch_size 32 "
            "(the learning rate may need lowering with it), or use mixed precision: --trainer.precision bf16-mixed. "
            "Resume the run with --ckpt_path last."
        )
    if config_error := find_in_chain(err, ConfigError):
        return str(config_error)
    while err is not None:  # torch's error for an op without a deterministic kernel
        if found := re.search(r"(\S+) does not have a deterministic implementation", str(err)):
            return (
                f"{found[1]} has no deterministic implementation on this device, and the config asks for one "
                "(trainer.deterministic: true, the default). Run with --trainer.deterministic warn to let it run "
                "nondeterministically (a warning names it; runs may then differ in the last bits), or replace that "
                "op in the model (for AdaptiveAvgPool2d, an input size that divides the output size exactly)."
            )
        err = err.__cause__ or err.__context__
    return None


@contextlib.contextmanager
def exit_on_user_error() -> Iterator[None]:
    """A user error as one paragraph on stderr and exit code 2; an error in the user's code names its frame."""
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
    """'file:line in function' of the innermost frame outside Python, the installed packages and this package,
    or None. A DataLoader worker's error carries its traceback as text."""
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

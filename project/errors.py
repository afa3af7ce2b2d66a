"""The one exception type the CLI turns into a readable paragraph instead of a traceback, and how to find it."""

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

"""The one exception type the CLI turns into a readable paragraph instead of a traceback."""


class ConfigError(ValueError):
    """Bad user input (config, data, checkpoint): the message says what is wrong, where, and the fix."""

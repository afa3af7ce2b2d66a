"""`python -m project <command>`: the tools start here without importing the training stack (seconds of
imports); everything else is LightningCLI (project/cli.py)."""

import importlib
import os
import sys

from project.errors import exit_on_user_error

# Each takes its own flags (`python -m project export --help`). `predict` replaces LightningCLI's.
TOOLS = {name: f"project.{name}" for name in ("predict", "export", "doctor", "sweep", "prepare")}


def main(args: list[str] | None = None) -> None:
    argv = sys.argv[1:] if args is None else list(args)
    if argv and argv[0] in TOOLS:
        with exit_on_user_error():
            importlib.import_module(TOOLS[argv[0]]).main(argv[1:])
        return
    if not any(os.environ.get(v, "0") != "0" for v in ("RANK", "LOCAL_RANK", "SLURM_PROCID")):
        # Seconds of imports follow, with nothing else printed (rank 0 only)
        print("Loading torch and Lightning...", file=sys.stderr, flush=True)
        from project.versions import warn_outside_pins

        warn_outside_pins()
    from project.cli import main as train_main  # fit, validate, test

    train_main(args)


if __name__ == "__main__":
    main()

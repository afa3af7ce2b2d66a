"""`python -m project <command>`: the tools run on their own, everything else is LightningCLI (project/cli.py).

`predict` and `export` need no Trainer: they are dispatched here, before project/cli.py (and with it lightning,
torchmetrics and the rest of the training stack, seconds of imports) is imported, so that a tool starts as fast
as torch itself (docs/performance.md "Start-up of predict and export"). `doctor` is a tool too; it parses the
config with the CLI's own parser, so it imports project/cli.py itself.
"""

import importlib
import os
import sys

from project.errors import exit_on_user_error

# Each takes its own flags (`python -m project export --help`); imported only when used. `predict` replaces
# LightningCLI's subcommand of that name, which would need a predict dataloader in the config.
TOOLS = {
    "predict": "project.predict",
    "export": "project.export",
    "doctor": "project.doctor",
    "sweep": "project.sweep",  # hyperparameter sweeps: each trial is a `fit` process of its own
    "prepare": "project.prepare",  # a dataset as litdata chunks for project.data.StreamingDataModule
}


def main(args: list[str] | None = None) -> None:
    argv = sys.argv[1:] if args is None else list(args)
    if argv and argv[0] in TOOLS:
        with exit_on_user_error():
            importlib.import_module(TOOLS[argv[0]]).main(argv[1:])
        return
    if not any(os.environ.get(v, "0") != "0" for v in ("RANK", "LOCAL_RANK", "SLURM_PROCID")):
        # Importing the training stack takes seconds in which nothing else would be printed (rank 0 only: the
        # other DDP ranks stay quiet)
        print("Loading torch and Lightning...", file=sys.stderr, flush=True)
        from project.versions import warn_outside_pins

        warn_outside_pins()
    from project.cli import main as train_main  # fit, validate, test

    train_main(args)


if __name__ == "__main__":
    main()

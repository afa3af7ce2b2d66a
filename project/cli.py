"""`python -m project {fit,validate,test}`: LightningCLI with run directories, data-to-model links, readable errors
and the test of the best checkpoint after fit."""

import argparse
import json
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Literal

import lightning as L
import torch
import yaml
from jsonargparse import ArgumentError, Namespace
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities.model_helpers import is_overridden

from project import links, run_dir
from project.callbacks.log_config import LogConfig, redact
from project.callbacks.report import RunReport, is_classifier
from project.checkpoint import check_checkpoint, read_checkpoint
from project.console import drop_inapplicable_messages
from project.distributed import describe_world, env_rank, quiet_non_zero_ranks
from project.errors import ConfigError, exit_on_user_error
from project.parse_errors import explain as explain_parse_error

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
SUBCOMMANDS = ("fit", "validate", "test")  # LightningCLI's; `predict` is a tool (project/__main__.py)
# The flags that set an argument of the config's RunCheckpoint
RUN_CHECKPOINT_FLAGS = dict(checkpoint_every_n_steps="every_n_train_steps", monitor="monitor", mode="mode")


def project_flags(
    run_dir: str | None = None,
    test_after_fit: bool = True,
    checkpoint_every_n_steps: int = 0,
    monitor: str | None = None,
    mode: Literal["min", "max"] | None = None,
) -> None:
    """The project's top-level flags (the last three set the config's RunCheckpoint, so config.yaml records them).

    Args:
        run_dir: Directory of this run (logs, checkpoints, config.yaml, summary.json). Default: runs/<time>; with
            --ckpt_path, the run of that checkpoint.
        test_after_fit: After fit, test the best checkpoint.
        checkpoint_every_n_steps: Also write checkpoints/last.ckpt every N optimizer steps, mid-epoch included
            (0 = off; RunCheckpoint's every_n_train_steps).
        monitor: The logged metric that selects best-*.ckpt (tested after fit), e.g. val_loss; ReduceLROnPlateau
            steps on it too.
        mode: min: the lowest --monitor value is best (a loss); max: the highest (an accuracy).
    """


def auto_precision() -> str:
    if torch.cuda.is_available():
        return "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"
    return "32-true"


class ProjectParser(LightningArgumentParser):
    """jsonargparse hands a builder function (torchvision.models.resnet18) the `linked_targets` it gives a class,
    which add_function_arguments does not take; jsonargparse then makes the linked arguments optional."""

    def add_function_arguments(self, function, *args, linked_targets=None, **kwargs) -> list[str]:
        return super().add_function_arguments(function, *args, **kwargs)


class ProjectCLI(LightningCLI):
    def __init__(self, *args, only_subcommands: Sequence[str] | None = None, **kwargs) -> None:
        # Only the parsers a start needs: each introspects every class of the config.
        self.only_subcommands = tuple(only_subcommands) if only_subcommands else None
        # LightningCLI parses sys.argv when given no args: the command line Lightning's DDP launcher re-runs.
        self.parsed_sys_argv = kwargs.get("args") is None
        # Until the parsed config names the classes (parse_arguments)
        self.link_targets = [target for _, target in links.DATA_TO_MODEL]
        self.links: dict[str, links.Link] = {}
        super().__init__(*args, **kwargs)

    def subcommands(self) -> dict[str, set[str]]:  # LightningCLI calls it on the instance
        every = {k: v for k, v in LightningCLI.subcommands().items() if k in SUBCOMMANDS}
        return {k: v for k, v in every.items() if self.only_subcommands is None or k in self.only_subcommands}

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_function_arguments(project_flags, nested_key=None)
        parser.set_defaults({"trainer.precision": auto_precision()})
        for target in self.link_targets:  # the value comes from the plan made after parsing (self.links)
            parser.link_arguments("data", target, partial(self.link_value, target), apply_on="instantiate")

    def link_value(self, target: str, data):
        return self.links[target].value(data)

    def setup_parser(self, *args, **kwargs) -> None:
        self.parser_setup = (args, kwargs)  # to build it again with other links (parse_arguments)
        super().setup_parser(*args, **kwargs)

    def parse_arguments(self, parser, args) -> None:
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        config = self.config[subcommand] if subcommand else self.config
        given = links.given_keys(sys.argv[1:] if args is None else args, [str(CONFIG_DIR / "default.yaml")])
        self.links = {link.target: link for link in links.plan(config, given)}
        if list(self.links) != self.link_targets:
            # A link to an argument the class lacks still reaches Lightning's hyperparameter recording, which
            # fails an assertion; a link over a given value overwrites it.
            self.link_targets = list(self.links)
            setup_args, setup_kwargs = self.parser_setup
            super().setup_parser(*setup_args, **setup_kwargs)
            super().parse_arguments(self.parser, args)
        # LightningCLI next torch.loads the checkpoint's hyperparameters: a bad file is a paragraph, not a traceback.
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if ckpt_path and str(ckpt_path) not in run_dir.LIGHTNING_CKPT_NAMES:
            read_checkpoint(ckpt_path, mmap=True)

    def before_instantiate_classes(self) -> None:
        subcommand = self.subcommand or "fit"  # None: build_cli(run=False) parses a fit config
        config = self.config[subcommand] if self.subcommand else self.config
        if subcommand == "fit":
            set_run_checkpoint(config)

        def saved() -> dict:  # the config as config.yaml holds it: a fit that continues its run compares them
            return yaml.safe_load(self.parser.dump(redact(self.config), skip_none=False))[subcommand]

        run_dir.prepare(config, subcommand, self.parsed_sys_argv, saved if self.subcommand else None)
        # Lightning records the hyperparameters from config_dump, then writes each linked value into it at
        # "model.init_args.<arg>": that failed for a nested class dumped without init_args (all its arguments linked).
        dump = yaml.safe_load(
            self.parser.dump(self.config, skip_link_targets=False, skip_none=False, format="yaml")
        )
        nodes = [dump[self.subcommand] if self.subcommand else dump]
        for node in nodes:
            if isinstance(node, dict) and "class_path" in node and node.get("init_args") is None:
                node["init_args"] = {}
            nodes += node.values() if isinstance(node, dict) else node if isinstance(node, list) else []
        self.config_dump = nodes[0]

    def instantiate_trainer(self, **kwargs) -> Trainer:
        # `--trainer.enable_progress_bar false` wins over the bar among the YAML's callbacks (the Trainer refuses
        # the pair), whatever class path named it.
        trainer = self.config_init.get(str(self.subcommand), self.config_init).get("trainer", {})
        if trainer.get("enable_progress_bar") is False:
            callbacks = trainer.get("callbacks") or []
            trainer["callbacks"] = [c for c in callbacks if not isinstance(c, ProgressBar)]
        return super().instantiate_trainer(**kwargs)

    def before_fit(self) -> None:
        ckpt_path = self.config.fit.get("ckpt_path")
        if ckpt_path and ckpt_path not in run_dir.LIGHTNING_CKPT_NAMES:  # another model: a paragraph
            check_checkpoint(ckpt_path, self.model)
        if isinstance(self.trainer.accelerator, CPUAccelerator) and self.config.fit.trainer.sync_batchnorm:
            raise ConfigError(
                "trainer.sync_batchnorm needs GPUs (SyncBatchNorm is CUDA-only), but this run is on CPU. "
                "Set --trainer.sync_batchnorm false."
            )
        loaders = [
            m for m in (self.model, self.datamodule) if m is not None and is_overridden("test_dataloader", m)
        ]
        self.untested = "" if loaders else "neither the module nor the data module has a test_dataloader"
        if not is_overridden("test_step", self.model):
            self.untested = f"{type(self.model).__name__} has no test_step"
        for callback in self.trainer.callbacks:  # written once, after the test that after_fit runs
            if isinstance(callback, RunReport | LogConfig):
                callback.test_follows_fit = bool(self.config.fit.test_after_fit) and not self.untested
        if self.trainer.world_size > 1 and env_rank() == 0:  # no process group yet: the launcher's rank
            batch = getattr(getattr(self.datamodule, "hparams", None), "batch_size", None)
            lr = self.model.scaled_lr(self.trainer.world_size) if hasattr(self.model, "scaled_lr") else None
            print(describe_world(self.trainer, batch, lr), flush=True)

    def after_fit(self) -> None:
        trainer = self.trainer
        if self.config.fit.test_after_fit and not trainer.interrupted:
            ckpt = trainer.checkpoint_callback  # its best file; none selected: the final weights
            best = ckpt.best_model_path if ckpt is not None and ckpt.best_model_path else None
            if not self.untested:
                trainer.test(self.model, datamodule=self.datamodule, ckpt_path=best, verbose=False)
            elif trainer.is_global_zero:
                print(f"No test after fit: {self.untested}.", flush=True)
        finish_wandb()  # its footer prints above the summary: the run directory stays the last line
        if trainer.is_global_zero:
            state = self.datamodule.state_dict() if self.datamodule else None
            print_summary(Path(trainer.default_root_dir), state, classifier=is_classifier(self.model))

    def after_test(self) -> None:
        finish_wandb()
        if self.trainer.is_global_zero and Path(self.trainer.default_root_dir).is_dir():  # fast_dev_run: none
            print(f"Run directory: {self.trainer.default_root_dir}", flush=True)

    after_validate = after_test


def set_run_checkpoint(config: Namespace) -> None:
    from project.callbacks import RunCheckpoint

    given = {(flag, key): config[flag] for flag, key in RUN_CHECKPOINT_FLAGS.items() if config.get(flag)}
    found = [c for c in config.trainer.callbacks or [] if run_dir.subclass_of(c.class_path, RunCheckpoint)]
    if given and not found:
        (flag, key), _ = next(iter(given.items()))
        raise ConfigError(
            f"--{flag} sets {key} of the config's project.callbacks.RunCheckpoint, and trainer.callbacks has "
            "none: add it (configs/default.yaml lists it) or drop the flag."
        )
    for (_, key), value in given.items():
        found[0].init_args[key] = value


def print_summary(run_dir: Path, data_state: dict | None = None, classifier: bool = True) -> None:
    """summary.json as a table, what to look at or run next (or what predict and export lack), then the run dir."""
    from rich.console import Console
    from rich.table import Table

    from project.data.normalize import contract_gaps

    gaps = contract_gaps(data_state)
    path = run_dir / "summary.json"
    if path.exists():
        summary = json.loads(path.read_text())
        table = Table(title="Run summary", show_header=False)
        for key, value in summary.items():  # in project/callbacks/run_summary.py's order
            if value is not None and value != "":
                table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
        Console().print(table)
        best = summary.get("best_checkpoint") or summary.get("last_checkpoint")
        if best and Path(best).is_absolute() and Path(best).is_relative_to(Path.cwd()):
            best = str(Path(best).relative_to(Path.cwd()))  # as the README's commands write it
        classifier = classifier and "test_acc" in summary
        if (run_dir / "report.png").exists():
            drawn = ", confusion matrix, wrong images" if classifier else ""
            print(f"Report: {run_dir / 'report.png'} (curves, learning rate{drawn})", flush=True)
        serve = f"   |   make predict CKPT={best} INPUT=<image or folder>   |   make export CKPT={best}"
        print(f"Next: make tensorboard{serve if classifier and not gaps and best else ''}", flush=True)
    if classifier and gaps and not (data_state or {}).get("dataset"):
        sys.stderr.write(
            f"note: make predict and make export need the data module's state_dict() to return {', '.join(gaps)} "
            '(docs/data.md "Predict and export").\n'
        )
    if run_dir.is_dir():
        print(f"Run directory: {run_dir}", flush=True)


def build_cli(
    args: list[str] | None = None, run: bool = True, cli_class: type[ProjectCLI] = ProjectCLI
) -> ProjectCLI:
    """The CLI with this project's defaults; `run=False` parses and instantiates without running."""
    default_config = {"default_config_files": [str(CONFIG_DIR / "default.yaml")], "exit_on_error": False}
    subcommands = requested_subcommands(sys.argv[1:] if args is None else args) if run else SUBCOMMANDS
    return cli_class(
        L.LightningModule,  # any, by class_path
        None,  # any LightningDataModule, or `--data null` for a module that brings its own loaders
        subclass_mode_model=True,
        subclass_mode_data=True,
        parser_class=ProjectParser,
        save_config_callback=LogConfig,
        save_config_kwargs={"overwrite": True},  # a resumed run rewrites config.yaml in place
        # Lightning's --optimizer/--lr_scheduler would replace the module's parameter groups and schedule.
        auto_configure_optimizers=False,
        # Parse errors are raised (not printed after 60 lines of usage) and shortened in main().
        parser_kwargs={"exit_on_error": False, **{s: default_config for s in subcommands}}
        if run
        else default_config,
        args=args,
        run=run,
        only_subcommands=subcommands,
    )


def resume_as_started(argv: list[str]) -> list[str]:
    """`fit --ckpt_path <last or a run's checkpoint>` without `--config`: the run's own config.yaml, so a resume
    continues the run as it was started. Every other flag is a change, recorded (run_dir.record_resume)."""
    flags = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for name in ("--ckpt_path", "--run_dir", "--config"):
        flags.add_argument(name, *["-c"] * (name == "--config"), action="append")
    given, changes = flags.parse_known_args(argv[1:])
    if argv[:1] != ["fit"] or given.config or not given.ckpt_path:  # with --config: that config is meant
        return argv
    run = run_dir.checkpoint_run(given.ckpt_path[-1])
    if run is None or not (run / "config.yaml").is_file():
        return argv
    run_dir.record_resume(run, given.ckpt_path[-1], changes)
    return ["fit", "--config", str(run / "config.yaml"), *argv[1:]]


def requested_subcommands(argv: Sequence[str]) -> tuple[str, ...]:
    """The subcommand named first on the command line, or all of them (for --help, typos and their messages)."""
    first = next((a for a in argv if not a.startswith("-")), None)
    return (first,) if first in SUBCOMMANDS else SUBCOMMANDS


def main(args: list[str] | None = None) -> None:
    argv = sys.argv[1:] if args is None else list(args)
    quiet_non_zero_ranks()
    drop_inapplicable_messages()
    finished = False
    run_dir.STARTED.clear()
    try:
        with exit_on_user_error():  # a ConfigError (or running out of GPU memory): one paragraph, exit code 2
            resumed = resume_as_started(argv)
            if resumed is not argv and args is None:  # Lightning's DDP launcher re-runs sys.argv
                sys.argv = [sys.argv[0], *resumed]
            elif resumed is not argv:
                args = resumed
            build_cli(args)
            finished = True
    except ArgumentError as err:
        print(f"\nerror: {explain_parse_error(str(err), argv)}\n", file=sys.stderr, flush=True)
        sys.exit(2)
    finally:
        if not finished:
            run_dir.discard_if_no_checkpoint()
        # W&B keeps its run, environment and service process for the rest of the process: a second run here (a
        # notebook, a test, a sweep) must start its own session.
        finish_wandb()
        if (wandb := sys.modules.get("wandb")) is not None:
            wandb.teardown()


def finish_wandb() -> None:
    """End the W&B run, if one is open: its footer (and offline its `wandb sync` command) prints at finish."""
    if (wandb := sys.modules.get("wandb")) is not None and wandb.run is not None:
        wandb.finish()

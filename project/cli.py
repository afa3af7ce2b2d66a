"""`python -m project {fit,validate,test}`: LightningCLI with run directories, argument links and readable errors.

What `make train` does, top-down: project/__main__.py hands every command but the tools (predict, export, doctor)
to `main` here; LightningCLI parses configs/default.yaml and the flags; `before_instantiate_classes` completes the
parsed config (extra callbacks, then the run directory: project/run_dir.py); LightningCLI builds the data module,
the module and the Trainer from it and runs the subcommand; the config's callbacks do the rest.
"""

import json
import sys
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Literal

import lightning as L
import torch
import yaml
from jsonargparse import ArgumentError, Namespace
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from project import links, run_dir
from project.callbacks.log_config import LogConfig
from project.callbacks.report import RunReport, is_classifier
from project.checkpoint import check_checkpoint, read_checkpoint
from project.console import drop_inapplicable_messages
from project.distributed import describe_world, env_rank, quiet_non_zero_ranks, share_cpu_threads
from project.errors import ConfigError, exit_on_user_error
from project.parse_errors import explain as explain_parse_error

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
SUBCOMMANDS = ("fit", "validate", "test")  # LightningCLI's; `predict` is a tool (project/__main__.py)


def auto_precision() -> str:
    """bf16-mixed on CUDA GPUs that support bf16, 16-mixed on older CUDA GPUs, 32-true on CPU."""
    if torch.cuda.is_available():
        return "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"
    return "32-true"


class ProjectParser(LightningArgumentParser):
    """jsonargparse hands a function's parser the link targets it gives a class's (`linked_targets`), which
    add_function_arguments does not take: a builder function (torchvision.models.resnet18) as the model failed to
    parse. They are accepted here; jsonargparse then makes the linked arguments optional, as for a class."""

    def add_function_arguments(self, function, *args, linked_targets=None, **kwargs) -> list[str]:
        return super().add_function_arguments(function, *args, **kwargs)


class ProjectCLI(LightningCLI):
    """LightningCLI with run directories, data-to-model links and readable errors.

    Args (besides LightningCLI's):
        only_subcommands: build the parser of these subcommands only (build_cli passes the one on the command
            line). Each subcommand's parser introspects every class of the config: building one instead of
            four spares most of LightningCLI's parser set-up at every start (~0.22 s to ~0.08 s on 2 CPU
            cores).
    """

    def __init__(self, *args, only_subcommands: Sequence[str] | None = None, **kwargs) -> None:
        self.only_subcommands = tuple(only_subcommands) if only_subcommands else None
        # LightningCLI parses sys.argv when given no args: the command line Lightning's DDP launcher re-runs.
        self.parsed_sys_argv = kwargs.get("args") is None
        # Link targets until the parsed config names the classes (parse_arguments, project/links.py)
        self.link_targets = [target for _, target in links.DATA_TO_MODEL]
        self.links: dict[str, links.Link] = {}
        super().__init__(*args, **kwargs)

    def subcommands(self) -> dict[str, set[str]]:  # LightningCLI calls it on the instance
        # `predict` is project/predict.py's (a tool without a Trainer), dispatched before LightningCLI.
        every = {k: v for k, v in LightningCLI.subcommands().items() if k in SUBCOMMANDS}
        return {k: v for k, v in every.items() if self.only_subcommands is None or k in self.only_subcommands}

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument(
            "--run_dir",
            type=str | None,
            default=None,
            help="Directory of this run (logs, checkpoints, config.yaml, summary.json). Default: a new "
            "runs/<time> directory; with --ckpt_path, the run that checkpoint belongs to.",
        )
        parser.add_argument(
            "--test_after_fit", type=bool, default=True, help="After fit, test the best checkpoint."
        )
        parser.add_argument(  # sets every_n_train_steps of the config's RunCheckpoint
            "--checkpoint_every_n_steps",
            type=int,
            default=0,
            help="Also write checkpoints/last.ckpt every N optimizer steps, mid-epoch included (0 = off; sets the "
            "config's RunCheckpoint every_n_train_steps; its wall-clock interval stays on).",
        )
        parser.add_argument(  # set monitor and mode of the config's RunCheckpoint
            "--monitor",
            type=str | None,
            default=None,
            help="The logged metric that selects best-*.ckpt (tested after fit), e.g. val_loss; ReduceLROnPlateau "
            "steps on it too. Sets the config's RunCheckpoint monitor (default: its own, val/loss).",
        )
        parser.add_argument(
            "--mode",
            type=Literal["min", "max"] | None,
            default=None,
            help="min: the lowest --monitor value is best (a loss); max: the highest (an accuracy). Sets the "
            "config's RunCheckpoint mode (default: its own, min).",
        )
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
        self.links = {
            link.target: link
            for link in links.plan(
                self.config[subcommand] if subcommand else self.config,
                links.given_keys(sys.argv[1:] if args is None else args, [str(CONFIG_DIR / "default.yaml")]),
            )
        }
        if list(self.links) != self.link_targets:
            # Only the links the classes take, and not over a value the user gave: a link to an argument a class
            # lacks is skipped by the parser but still handed to Lightning's hyperparameter recording, which then
            # failed an assertion; a link writes over the user's value.
            self.link_targets = list(self.links)
            setup_args, setup_kwargs = self.parser_setup
            super().setup_parser(*setup_args, **setup_kwargs)
            super().parse_arguments(self.parser, args)
        # LightningCLI next reads the checkpoint's hyperparameters (torch.load): a missing, truncated or foreign file
        # must be one readable paragraph, not an unpickling traceback. mmap: only the index is read.
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if ckpt_path and str(ckpt_path) not in run_dir.LIGHTNING_CKPT_NAMES:
            read_checkpoint(ckpt_path, mmap=True)

    def before_instantiate_classes(self) -> None:
        # The parsed config is completed here, before any class is built: flags that add callbacks first, then
        # the run directory, which every writer in the config is pointed at (project/run_dir.py).
        subcommand = (
            self.subcommand or "fit"
        )  # None: build_cli(run=False) parses a fit config without a subcommand
        config = self.config[subcommand] if self.subcommand else self.config
        trainer = config.trainer
        for flag, key in RUN_CHECKPOINT_FLAGS.items():
            if subcommand == "fit" and config.get(flag):
                set_run_checkpoint(trainer.callbacks, flag, key, config[flag])
        run_dir.prepare(config, subcommand, command_line=self.parsed_sys_argv)
        # Last, as the config is now built from: Lightning records the module's hyperparameters from
        # `self.config_dump` (it dumps the config itself only when none is set), then writes each linked value
        # (num_classes, in_channels) into it at "model.init_args.<arg>". A nested class whose every argument is
        # linked is dumped without an init_args key, and Lightning's writer then failed an assertion ("Expected key
        # model.init_args.num_classes to be in data"): a user model taking only num_classes and in_channels crashed.
        self.config_dump = hyperparameter_dump(self.parser, self.config)

    def instantiate_trainer(self, **kwargs) -> Trainer:
        # `--trainer.enable_progress_bar false` wins over the bar in the YAML's callbacks (the Trainer would refuse
        # the pair): the instantiated callbacks are checked by type, whatever class path named them.
        config = self.config_init.get(str(self.subcommand), self.config_init)  # the subcommand's part, if any
        trainer = config.get("trainer", {})
        if trainer.get("enable_progress_bar") is False:
            trainer["callbacks"] = [
                c for c in trainer.get("callbacks") or [] if not isinstance(c, ProgressBar)
            ]
        return super().instantiate_trainer(**kwargs)

    def before_fit(self) -> None:
        # A truncated, foreign or other-architecture checkpoint is one readable paragraph, not a state_dict dump.
        ckpt_path = self.config.fit.get("ckpt_path")
        if ckpt_path and ckpt_path not in run_dir.LIGHTNING_CKPT_NAMES:
            check_checkpoint(ckpt_path, self.model)
        if (
            self.config.fit.trainer.get("sync_batchnorm")
            and type(self.trainer.accelerator).__name__ == "CPUAccelerator"
        ):
            # torch's SyncBatchNorm runs on CUDA only; without this check every rank dies in DDP setup.
            raise ConfigError(
                "trainer.sync_batchnorm needs GPUs (SyncBatchNorm is CUDA-only), but this run is on CPU. "
                "Set --trainer.sync_batchnorm false."
            )
        self.untested = untestable(self.model, self.datamodule)  # the after-fit test is skipped, said why
        for callback in self.trainer.callbacks:  # written once, after the test that after_fit runs
            if isinstance(callback, RunReport | LogConfig):
                callback.test_follows_fit = bool(self.config.fit.test_after_fit) and not self.untested
        if self.trainer.world_size > 1:  # DDP: say what one optimizer step sees (rank 0 only)
            share_cpu_threads(self.trainer)  # runs in every rank: each one parses the CLI
            batch = getattr(getattr(self.datamodule, "hparams", None), "batch_size", None)
            lr = self.model.scaled_lr(self.trainer.world_size) if hasattr(self.model, "scaled_lr") else None
            if env_rank() == 0:  # the process group does not exist yet: the launcher's rank
                print(describe_world(self.trainer, batch, lr), flush=True)

    def after_fit(self) -> None:
        trainer = self.trainer
        if self.config.fit.test_after_fit and not trainer.interrupted:
            ckpt = trainer.checkpoint_callback
            # The run's checkpoint callback's best file (None when no epoch was selected: the final weights).
            best = ckpt.best_model_path if ckpt is not None and ckpt.best_model_path else None
            if not self.untested:
                trainer.test(self.model, datamodule=self.datamodule, ckpt_path=best, verbose=False)
            elif trainer.is_global_zero:
                print(f"No test after fit: {self.untested}.", flush=True)
        finish_wandb()  # its footer prints here, above the summary: the run directory stays the last line
        if trainer.is_global_zero:  # with what predict and export lack of the data module's state (or None)
            state = self.datamodule.state_dict() if self.datamodule else None
            print_summary(Path(trainer.default_root_dir), state, classifier=is_classifier(self.model))

    def after_test(self) -> None:
        finish_wandb()
        if self.trainer.is_global_zero:  # Lightning has printed the metrics; say where the files went
            print_run_dir(Path(self.trainer.default_root_dir))

    after_validate = after_test


def hyperparameter_dump(parser, config: Namespace) -> dict:
    """The config as LightningCLI dumps it to record hyperparameters (link targets and None values kept; the
    subcommand's part), with an init_args mapping in every {class_path: ...} node."""
    dump = yaml.safe_load(parser.dump(config, skip_link_targets=False, skip_none=False, format="yaml"))
    if "subcommand" in config:
        dump = dump[config.subcommand]
    _add_missing_init_args(dump)
    return dump


def _add_missing_init_args(node) -> None:
    """Give every {class_path: ...} mapping in a config dump an init_args mapping (empty if it had none)."""
    if isinstance(node, dict):
        if "class_path" in node and node.get("init_args") is None:
            node["init_args"] = {}
        for value in node.values():
            _add_missing_init_args(value)
    elif isinstance(node, list):
        for value in node:
            _add_missing_init_args(value)


# Top-level flags that set an argument of the config's RunCheckpoint: {flag: its argument}
RUN_CHECKPOINT_FLAGS = {
    "checkpoint_every_n_steps": "every_n_train_steps",
    "monitor": "monitor",
    "mode": "mode",
}


def set_run_checkpoint(callbacks: list | None, flag: str, key: str, value) -> None:
    """A flag's value into the config's RunCheckpoint init_args (config.yaml records it, so a resume keeps it):
    `--checkpoint_every_n_steps N` (last.ckpt every N optimizer steps, mid-epoch included), `--monitor`, `--mode`."""
    import pydoc

    from project.callbacks import RunCheckpoint

    for callback in callbacks or []:
        cls = pydoc.locate(callback.class_path)  # the parser has imported it already
        if isinstance(cls, type) and issubclass(cls, RunCheckpoint):
            callback.init_args[key] = value
            return
    raise ConfigError(
        f"--{flag} sets {key} of the config's project.callbacks.RunCheckpoint, and trainer.callbacks has none: add "
        "it (configs/default.yaml lists it) or drop the flag."
    )


def untestable(model: L.LightningModule, datamodule: L.LightningDataModule | None) -> str:
    """Why the after-fit test cannot run ("" when it can): Lightning's trainer.test needs a test_step and a loader."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    if not is_overridden("test_step", model):
        return f"{type(model).__name__} has no test_step"
    if not any(is_overridden("test_dataloader", m) for m in (model, datamodule) if m is not None):
        return "neither the module nor the data module has a test_dataloader"
    return ""


# summary.json's keys in the order a person reads them: the verdict first, then where the files are
SUMMARY_FIRST = ("test_acc", "test_loss", "best_val_acc", "epochs", "train_seconds")


def print_summary(run_dir: Path, data_state: dict | None = None, classifier: bool = True) -> None:
    """The run's summary.json as a table (the test result first), what to look at or run next, then the run dir.
    classifier: a module RunReport draws a confusion matrix for, and predict and export serve; they are named when
    the data module's state has what they read (contract_gaps), and a note says what it lacks (none for a
    DatasetDataModule, whose data is not images)."""
    import json

    from rich.console import Console
    from rich.table import Table

    from project.inference import contract_gaps

    gaps = contract_gaps(data_state)
    path = run_dir / "summary.json"
    if path.exists():
        summary = json.loads(path.read_text())
        table = Table(title="Run summary", show_header=False)
        ordered = [k for k in SUMMARY_FIRST if k in summary] + [k for k in summary if k not in SUMMARY_FIRST]
        for key in ordered:
            value = summary[key]
            # best_val_acc of a module that logs no val/acc, best_checkpoint of a run that selects none
            if value is None or value == "":
                continue
            table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
        Console().print(table)
        best = summary.get("best_checkpoint") or summary.get("last_checkpoint")
        if best and Path(best).is_absolute() and Path(best).is_relative_to(Path.cwd()):
            best = str(Path(best).relative_to(Path.cwd()))  # as the README's commands write it
        report = run_dir / "report.png"
        classifier = classifier and "test_acc" in summary
        if report.exists():
            drawn = ", confusion matrix, wrong images" if classifier else ""
            print(f"Report: {report} (curves, learning rate{drawn})", flush=True)
        if not classifier or gaps:
            print("Next: make tensorboard", flush=True)
        elif best:
            print(
                f"Next: make tensorboard   |   make predict CKPT={best} INPUT=<image or folder>   |   "
                f"make export CKPT={best}",
                flush=True,
            )
    if classifier and gaps and not (data_state or {}).get("dataset"):
        print(
            f"note: make predict and make export need the data module's state_dict() to return {', '.join(gaps)} "
            '(docs/data.md "Predict and export").',
            file=sys.stderr,
            flush=True,
        )
    print_run_dir(run_dir)


def print_run_dir(run_dir: Path) -> None:
    """The last line of a run: where its files went. A run that wrote nothing (fast_dev_run) names no directory."""
    if run_dir.is_dir():
        print(f"Run directory: {run_dir}", flush=True)


def build_cli(
    args: list[str] | None = None, run: bool = True, cli_class: type[ProjectCLI] = ProjectCLI
) -> ProjectCLI:
    """The CLI with this project's defaults; `run=False` parses and instantiates without running.
    `cli_class`: a ProjectCLI subclass (the doctor's stops after parsing)."""
    default_config = {"default_config_files": [str(CONFIG_DIR / "default.yaml")], "exit_on_error": False}
    subcommands = requested_subcommands(sys.argv[1:] if args is None else args) if run else SUBCOMMANDS
    return cli_class(
        # Any LightningModule by class_path (configs/default.yaml names ClassificationModule; configs/autoencoder.yaml
        # another task).
        L.LightningModule,
        # Any LightningDataModule by class_path (configs/default.yaml names ImageClassificationDataModule; README
        # "Any Dataset": project.data.DatasetDataModule). None: LightningCLI's optional `data`, so that `--data null`
        # runs a module that brings its own loaders (lightning.pytorch.demos' BoringModel).
        None,
        subclass_mode_model=True,
        subclass_mode_data=True,
        parser_class=ProjectParser,
        save_config_callback=LogConfig,  # config.yaml without secrets, config + sizes logged as hparams
        save_config_kwargs={"overwrite": True},  # a resumed run rewrites config.yaml in place
        # No top-level --optimizer/--lr_scheduler: LightningCLI's would replace the module's configure_optimizers
        # (its parameter groups and schedule); the module's own keys configure both (refuse_top_level_optimizer).
        auto_configure_optimizers=False,
        # Parse errors are raised (not printed after 60 lines of usage) and shortened in main().
        parser_kwargs={"exit_on_error": False, **{s: default_config for s in subcommands}}
        if run
        else default_config,
        args=args,
        run=run,
        only_subcommands=subcommands,
    )


RESUMES = "resumes.jsonl"  # in the run directory: each resume of the run and the changes it made


def resume_as_started(argv: list[str]) -> list[str]:
    """`fit --ckpt_path <last or a run's checkpoint>` without `--config`: the run's own config.yaml, not
    configs/default.yaml, so a resume continues the run as it was started (its loggers, epochs, data, model).

    Every other flag on the command line is an explicit change to that config: printed, recorded in the run's
    resumes.jsonl, and written into its config.yaml with the rest. With `--config` given, the command is taken as
    it is (the config named is the one meant). Returns argv itself when nothing is to be done.
    """
    if (
        not argv
        or argv[0] != "fit"
        or any(a in ("--config", "-c") or a.startswith("--config=") for a in argv)
    ):
        return argv
    ckpt_path, rest, i = None, [], 1
    while i < len(argv):
        arg = argv[i]
        if arg in ("--ckpt_path", "--run_dir") and i + 1 < len(argv):
            ckpt_path = argv[i + 1] if arg == "--ckpt_path" else ckpt_path
            i += 2
            continue
        if arg.startswith(("--ckpt_path=", "--run_dir=")):
            ckpt_path = arg.split("=", 1)[1] if arg.startswith("--ckpt_path=") else ckpt_path
        else:
            rest.append(arg)
        i += 1
    run = run_dir.checkpoint_run(ckpt_path)
    config = run / "config.yaml" if run is not None else None
    if config is None or not config.is_file():
        return argv
    changes = " ".join(rest)
    if env_rank() == 0:
        said = f"; changed by this command: {changes}" if changes else " (no change)"
        print(f"Resuming {run} as it was started: its config.yaml{said}.", flush=True)
        record = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "ckpt_path": str(ckpt_path), "changes": rest}
        with open(run / RESUMES, "a", encoding="utf-8") as f:  # one line per resume
            f.write(json.dumps(record) + "\n")
    return ["fit", "--config", str(config), *argv[1:]]


def requested_subcommands(argv: Sequence[str]) -> tuple[str, ...]:
    """The subcommand named first on the command line, or all of them (for --help, typos and their messages)."""
    first = next((a for a in argv if not a.startswith("-")), None)
    return (first,) if first in SUBCOMMANDS else SUBCOMMANDS


TOP_LEVEL_OPTIMIZER_FLAGS = ("--optimizer", "--lr_scheduler")


def refuse_top_level_optimizer(argv: Sequence[str]) -> None:
    """LightningCLI's top-level --optimizer/--lr_scheduler would replace ClassificationModule.configure_optimizers
    and with it the parameter groups (no weight decay on biases and norms) and the warmup-cosine schedule; this
    parser does not have them, and one paragraph names the module's keys instead of a parse error."""
    given = [a for a in argv if a.split("=", 1)[0].split(".", 1)[0] in TOP_LEVEL_OPTIMIZER_FLAGS]
    if given:
        raise ConfigError(
            f"{given[0].split('=', 1)[0]} is Lightning's top-level flag, which would replace the module's "
            "configure_optimizers: its parameter groups (no weight decay on biases and norm layers) and its "
            "warmup-cosine schedule would be dropped silently. Set the module's instead: --model.init_args.optimizer "
            "torch.optim.SGD --model.init_args.optimizer.init_args.lr 0.1 (any torch optimizer), and "
            "--model.init_args.scheduler <class path, or null for a constant lr>."
        )


def main(args: list[str] | None = None) -> None:
    argv = sys.argv[1:] if args is None else list(args)
    quiet_non_zero_ranks()  # DDP: rank 0 speaks for the run
    drop_inapplicable_messages()  # Lightning's ads; a CSVLogger warning the run dir always triggered
    finished = False
    run_dir.STARTED.clear()
    try:
        with exit_on_user_error():  # a ConfigError (or running out of GPU memory): one paragraph, exit code 2
            refuse_top_level_optimizer(argv)
            resumed = resume_as_started(argv)
            if resumed is not argv and args is None:
                # still parsed from sys.argv: Lightning's DDP launcher re-runs sys.argv for the other ranks
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
        # A second run in this process (a notebook, a test, a sweep) starts its own W&B session: WandbLogger would
        # attach to a run still open (flushed only at exit), and W&B's setup keeps the environment it first saw
        # (WANDB_MODE, WANDB_BASE_URL, the key) and its service process for the rest of the process: finish() ends
        # the run (and clears wandb.run, which teardown() alone leaves set), teardown() forgets the rest.
        finish_wandb()
        if (wandb := sys.modules.get("wandb")) is not None:
            wandb.teardown()


def finish_wandb() -> None:
    """End the W&B run, if one is open (rank 0 only opens one): W&B prints its footer (run history, and offline its
    `wandb sync <folder>` command) when the run finishes, which was at exit, below `Run directory:`. The CLI calls
    it after the command's last stage, when every callback has logged."""
    if (wandb := sys.modules.get("wandb")) is not None and wandb.run is not None:
        wandb.finish()

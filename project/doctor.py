"""`python -m project doctor [--config X ...] [--data.init_args.root DIR ...]`: is this machine ready to train?

Prints versions, the CUDA build against the driver, GPUs, distributed backends, CPUs and loader workers,
the run directory and the configured data; then one `ok:` or `problem:` line per check, each problem with its
fix. Exits 1 when a problem would stop `make train`. The config is the one `fit` would run, read by the CLI's own
parser (`training_config`).
"""

import os
import platform
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path


class _Parsed(Exception):
    """Carries the parsed config out of LightningCLI's constructor, before it builds anything."""

    def __init__(self, config) -> None:
        super().__init__("config parsed")
        self.config = config


def training_config(args: list[str]) -> dict:
    """The `fit` config that `python -m project fit ARGS` would train with, as a plain dict.

    Parsed by the CLI's own parser (build_cli): configs/default.yaml, each --config overlay with its `+` appends,
    the dotted flags, defaults and types, exactly as `make train` reads them. The CLI stops right after parsing:
    no run directory is made, no data is loaded, no class is built. Raises jsonargparse's ArgumentError (or a
    ConfigError for a checkpoint that cannot be read) when `make train` would refuse the same arguments.
    """
    from project.cli import ProjectCLI, build_cli

    class ParseOnly(ProjectCLI):
        def parse_arguments(self, parser, args) -> None:
            super().parse_arguments(parser, args)
            raise _Parsed(self.config)

    try:
        with warnings.catch_warnings():  # args given in-process: Lightning asks whether sys.argv was meant
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
            build_cli(["fit", *args], cli_class=ParseOnly)
    except _Parsed as parsed:
        return parsed.config.fit.as_dict()
    raise AssertionError("ProjectCLI returned without parsing its arguments")  # parse_arguments always raises


def _driver() -> tuple[str | None, str | None]:
    """(driver version, highest CUDA version it supports) from nvidia-smi, or (None, None)."""
    if shutil.which("nvidia-smi") is None:
        return None, None
    try:
        out = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None, None
    drv, cuda = re.search(r"Driver Version:\s*([\d.]+)", out), re.search(r"CUDA Version:\s*([\d.]+)", out)
    return (drv.group(1) if drv else None), (cuda.group(1) if cuda else None)


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:2])


def _writable(path: Path) -> bool:
    from project.errors import ConfigError
    from project.run_dir import check_writable

    try:  # the check `make train` runs before training: a real write, in the nearest existing folder
        check_writable(path)
    except ConfigError:
        return False
    return True


def check_data(data: dict) -> tuple[str, str | None]:
    """(description, problem or None) for the configured data source."""
    from project.errors import ConfigError

    args = data.get("init_args", {}) or {}
    class_path = str(data.get("class_path") or "ImageClassificationDataModule")
    if not class_path.endswith("ImageClassificationDataModule"):
        return _check_class_paths(class_path, args)
    source, root = args.get("source", "digits"), args.get("root")
    if source == "digits":
        return "digits: embedded (project/data/digits.csv.gz), no files needed", None
    if root is None:
        return (
            f"{source}: no root",
            f"data source '{source}' needs a directory. fix: set --data.init_args.root DIR.",
        )
    if source == "imagefolder":
        from project.data import image_folder

        try:
            classes, (h, w) = image_folder.describe(root)
        except ConfigError as err:
            return (
                f"imagefolder at {root}: not usable",
                f"{err} fix: put the images there or point root elsewhere.",
            )
        return f"imagefolder at {root}: {len(classes)} classes, first image {h}x{w}", None
    from project.data.torchvision_datasets import DATASETS

    folder = Path(root) / DATASETS[source][2]
    if folder.is_dir():
        return f"{source} at {folder}: present", None
    if args.get("download"):
        return f"{source}: will be downloaded to {folder}", None
    return f"{source}: '{folder}' missing", (
        f"{source} files are not under '{folder}'. fix: copy them there, or add --data.init_args.download true "
        "on a machine with network access."
    )


def _check_class_paths(class_path: str, args: dict) -> tuple[str, str | None]:
    """Another data module (a DatasetDataModule, ...): its class and the classes and functions it names (datasets,
    collate_fn) are imported, not built; what they read is checked when training starts."""
    import importlib

    named = {"data": class_path}
    for key, value in args.items():
        if isinstance(value, dict) and value.get("class_path"):
            named[key] = str(value["class_path"])
        elif (
            key == "collate_fn" and value is not None
        ):  # the parser imported it already (a bad path fails there)
            named[key] = value if isinstance(value, str) else f"{value.__module__}.{value.__qualname__}"
    failed = []
    for key, path in named.items():
        module, _, name = path.rpartition(".")
        try:
            getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError) as err:
            failed.append(f"{key}: {path} ({type(err).__name__}: {err})")
    text = ", ".join(f"{k} {v}" for k, v in named.items() if k != "data")
    description = f"{class_path}" + (f" ({text})" if text else "") + ": imported, built when training starts"
    if failed:
        return description, (
            f"cannot import {'; '.join(failed)}. fix: correct the class path in the config, or make its module "
            "importable (run from the folder that holds it, or install it)."
        )
    return description, None


def _logger_classes(logger) -> list[str]:
    """Class names of the configured loggers, one per class as the CLI keeps them (first position, last settings)."""
    if logger is True:  # Lightning's default
        return ["TensorBoardLogger"]
    entries = logger if isinstance(logger, list) else [logger] if isinstance(logger, dict) else []
    return list(dict.fromkeys(str(e.get("class_path", "?")).rsplit(".", 1)[-1] for e in entries))


def doctor(args: list[str]) -> int:
    import lightning
    import torch
    import torch.distributed as dist
    import torchmetrics
    from jsonargparse import ArgumentError

    from project.cpus import usable_cpus
    from project.data.loaders import default_num_workers
    from project.errors import ConfigError

    blocking, notes = [], []
    try:
        config: dict | None = training_config(args)
    except (ArgumentError, ConfigError) as err:
        config = None
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        blocking.append(
            f"`make train` would refuse these arguments ({first}). "
            "fix: correct the flag or config file (`python -m project fit --help` lists every key)."
        )
    trainer, data = (config or {}).get("trainer") or {}, (config or {}).get("data") or {}
    say = print
    say(f"python        {platform.python_version()} ({sys.executable})")
    say(
        f"torch         {torch.__version__}   lightning {lightning.__version__}   torchmetrics {torchmetrics.__version__}"
    )
    driver, driver_cuda = _driver()
    say(f"CUDA build    {torch.version.cuda or 'no (CPU-only torch)'}")
    say(
        f"CUDA driver   {driver or 'none found (no nvidia-smi)'}"
        + (f", supports CUDA <= {driver_cuda}" if driver_cuda else "")
    )
    available = torch.cuda.is_available()
    say(f"cuda.is_available  {available}")
    for i in range(torch.cuda.device_count() if available else 0):
        p = torch.cuda.get_device_properties(i)
        say(f"  GPU {i}: {p.name}, {p.total_memory / 2**30:.1f} GiB, compute {p.major}.{p.minor}")
    if available:
        say(f"bf16          {torch.cuda.is_bf16_supported()}")
    nccl, gloo = (
        dist.is_available() and dist.is_nccl_available(),
        dist.is_available() and dist.is_gloo_available(),
    )
    say(f"distributed   NCCL {nccl}, gloo {gloo}")
    image_module = str(data.get("class_path") or "ImageClassificationDataModule").endswith(
        "ImageClassificationDataModule"
    )
    source = (data.get("init_args") or {}).get("source", "digits") if image_module else data["class_path"]
    configured = (data.get("init_args") or {}).get("num_workers")
    devices = str(trainer.get("devices", "auto"))
    procs = int(devices) if devices.isdigit() else (torch.cuda.device_count() if available else 1)
    # Only ImageFolder decodes files per sample; every other source is a tensor in memory (0 workers). Another data
    # module's Dataset may read files: it gets the count for that (project/data/dataset_module.py).
    reads_files = source == "imagefolder" or not image_module
    workers = configured if configured is not None else default_num_workers(reads_files, procs)
    say(f"CPUs          {usable_cpus()} usable; data loader workers per process: {workers}")
    run_dir = Path((config or {}).get("run_dir") or "runs")
    writable = _writable(run_dir)
    say(f"run dir       {run_dir.resolve()} ({'writable' if writable else 'NOT writable'})")
    data_problem = None
    if config is None:
        say("config        not read: see the problem below")
    else:
        loggers = _logger_classes(trainer.get("logger"))
        say(f"loggers       {', '.join(loggers) or 'none'}")
        if "WandbLogger" in loggers:
            from project.loggers import wandb_key_configured

            mode = os.environ.get("WANDB_MODE") or (
                "online" if wandb_key_configured() else "offline (no API key)"
            )
            say(f"W&B           {mode}")
        data_text, data_problem = check_data(data)
        say(f"data          {data_text}")
    say("")

    accel = str(trainer.get("accelerator", "auto"))
    if (
        torch.version.cuda
        and driver_cuda
        and _version_tuple(driver_cuda) < _version_tuple(torch.version.cuda)
    ):
        notes.append(
            f"the driver supports CUDA {driver_cuda} but torch was built for {torch.version.cuda}. "
            "fix: update the NVIDIA driver, or install a torch build for CUDA <= the driver's."
        )
    if accel in ("gpu", "cuda") and not available:
        blocking.append(
            f"trainer.accelerator is '{accel}' but no CUDA GPU is usable. "
            "fix: --trainer.accelerator auto (falls back to CPU), or install a CUDA build of torch."
        )
    elif not available:
        why = (
            "CPU-only torch"
            if not torch.version.cuda
            else "no NVIDIA driver"
            if driver is None
            else "no GPU visible"
        )
        say(f"ok: no CUDA GPU ({why}); training runs on the CPU (fine for the default digits run).")
    else:
        say(f"ok: {torch.cuda.device_count()} CUDA GPU(s) usable.")
    if available and torch.cuda.device_count() > 1 and not nccl:
        notes.append(
            "several GPUs but no NCCL: DDP would be slow or fail. fix: install a CUDA torch build with NCCL."
        )
    if writable:
        say(f"ok: run directory {run_dir} is writable.")
    else:
        blocking.append(
            f"cannot write '{run_dir}'. fix: make it writable, or pass --run_dir to a writable place."
        )
    if data_problem:
        blocking.append(data_problem)
    elif config is not None and not image_module:
        say(f"ok: data module {source} and the classes it names import.")
    elif config is not None:
        say(f"ok: data ({source}) is present.")
    for text in notes:
        say(f"problem (training still starts): {text}")
    for text in blocking:
        say(f"problem: {text}")
    say(
        "doctor: ready for `make train`."
        if not blocking
        else f"doctor: {len(blocking)} problem(s) would stop `make train`."
    )
    return 1 if blocking else 0


def main(args: list[str]) -> None:
    if args and args[0] in ("-h", "--help"):
        print(__doc__)
        return
    code = doctor(args)
    if code:
        sys.exit(code)

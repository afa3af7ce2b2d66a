"""`python -m project doctor [--config X ...] [--data.init_args.root DIR ...]`: is this machine ready to train?

Prints versions, the CUDA build against the driver, GPUs, distributed backends, CPUs and loader workers,
the run directory and the configured data; then one `ok:` or `problem:` line per check, each problem with its
fix. Exits 1 when a problem would stop `make train`. Reads the same configs as `fit` (default.yaml first).
"""

import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


def load_config(args: list[str]) -> tuple[dict, list[str]]:
    """default.yaml, then each --config file, then dotted --key value overrides (values parsed as YAML)."""
    files, overrides, i = [CONFIG_DIR / "default.yaml"], [], 0
    while i < len(args):
        key, _, value = args[i].partition("=")
        if not key.startswith("--"):
            raise SystemExit(
                f"doctor: unexpected argument '{args[i]}'; use --config FILE or --dotted.key VALUE."
            )
        if not value:
            i, value = i + 1, args[i + 1] if i + 1 < len(args) else ""
        if key == "--config":
            files.append(Path(value))
        else:
            overrides.append((key[2:], yaml.safe_load(value)))
        i += 1
    config, problems = {}, []
    for f in files:
        if not f.is_file():
            problems.append(f"config file '{f}' does not exist. fix: check the --config / CONFIG path.")
            continue
        _merge(config, yaml.safe_load(f.read_text()) or {})
    for key, value in overrides:
        node = config
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return config, problems


def _merge(into: dict, new: dict) -> None:
    for key, value in new.items():
        key = key.rstrip("+")  # `logger+:` appends; for these checks a replace is enough
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


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


def doctor(args: list[str]) -> int:
    import lightning
    import torch
    import torch.distributed as dist
    import torchmetrics

    from project.data.datamodule import default_num_workers

    config, problems = load_config(args)
    blocking, notes = list(problems), []
    trainer, data = config.get("trainer", {}) or {}, config.get("data", {}) or {}
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
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    source = (data.get("init_args") or {}).get("source", "digits")
    configured = (data.get("init_args") or {}).get("num_workers")
    procs = torch.cuda.device_count() if available else 1
    # In-memory sources (everything but imagefolder) load with 0 workers; see default_num_workers.
    workers = (
        configured
        if configured is not None
        else (default_num_workers(object(), procs) if source == "imagefolder" else 0)
    )
    say(f"CPUs          {cpus} usable; data loader workers per process: {workers}")
    run_dir = Path(config.get("run_dir") or "runs")
    writable = _writable(run_dir)
    say(f"run dir       {run_dir.resolve()} ({'writable' if writable else 'NOT writable'})")
    loggers = trainer.get("logger") if isinstance(trainer.get("logger"), list) else []
    if any(str(lg.get("class_path", "")).endswith("WandbLogger") for lg in loggers if isinstance(lg, dict)):
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
    else:
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

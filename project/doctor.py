"""`python -m project doctor [--config X ...] [--data.init_args.root DIR ...]`: is this machine ready to train?

Prints versions, the CUDA build, GPUs, distributed backends, CPUs and loader workers, the run directory and the
configured data (the config `fit` would run, read by the CLI's own parser); then one `ok:` or `problem:` line per
check, each problem with its fix. Exits 1 when a problem would stop `make train`.
"""

import os
import platform
import sys
import warnings
from pathlib import Path


class _Parsed(Exception):  # carries the parsed config out of LightningCLI's constructor, before it builds
    pass


def training_config(args: list[str]) -> dict:
    """The `fit` config of `python -m project fit ARGS`, read by the CLI's own parser; nothing is built. Raises
    jsonargparse's ArgumentError (or a ConfigError) where `make train` would refuse the arguments."""
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
        return parsed.args[0].fit.as_dict()
    raise AssertionError("ProjectCLI returned without parsing its arguments")


def check_data(data: dict) -> tuple[str, str | None]:
    """(description, problem or None) for the configured data."""
    from project.errors import ConfigError

    args, class_path = data.get("init_args") or {}, data.get("class_path", "ImageClassificationDataModule")
    source, root = args.get("source", "digits"), args.get("root")
    if not class_path.endswith("ImageClassificationDataModule"):  # parsing imported it and what it names
        named = [
            f"{k} {v['class_path']}" for k, v in args.items() if isinstance(v, dict) and "class_path" in v
        ]
        if callable(fn := args.get("collate_fn")):
            named.append(f"collate_fn {fn.__module__}.{fn.__qualname__}")
        return f"{class_path}{' (' * bool(named)}{', '.join(named)}{')' * bool(named)}: imported", None
    if source == "digits":
        return "digits: embedded (project/data/digits.csv.gz), no files needed", None
    if root is None:
        return (
            f"{source}: no root",
            f"data source '{source}' needs a directory. fix: --data.init_args.root DIR.",
        )
    if source == "imagefolder":
        from project.data.image_folder import describe

        try:
            classes, (h, w) = describe(root)
        except ConfigError as err:
            return f"imagefolder at {root}: not usable", f"{err} fix: put the images there or set root."
        return f"imagefolder at {root}: {len(classes)} classes, first image {h}x{w}", None
    from project.data.torchvision_datasets import DATASETS

    folder = Path(root) / DATASETS[source][2]
    if folder.is_dir() or args.get("download"):
        return f"{source} at {folder}: {'present' if folder.is_dir() else 'will be downloaded'}", None
    fix = f"{source} files are not under '{folder}'. fix: copy them there, or --data.init_args.download true."
    return f"{source}: '{folder}' missing", fix


def doctor(args: list[str]) -> int:
    import lightning
    import torch
    import torch.distributed as dist
    import torchmetrics
    from jsonargparse import ArgumentError

    from project.data.loaders import default_num_workers
    from project.errors import ConfigError
    from project.run_dir import check_writable

    stops, oks = [], []  # problems that stop `make train`, passed checks
    try:
        config = training_config(args)
    except (ArgumentError, ConfigError) as err:
        config, first = {}, (str(err).strip().splitlines() or [type(err).__name__])[0]
        stops.append(f"`make train` would refuse these arguments ({first}). fix: `make train ARGS=--help`.")
    trainer, data = config.get("trainer") or {}, config.get("data") or {}
    init, class_path = data.get("init_args") or {}, data.get("class_path", "ImageClassificationDataModule")
    image_module = class_path.endswith("ImageClassificationDataModule")
    source = init.get("source", "digits") if image_module else class_path
    with warnings.catch_warnings(record=True) as caught:  # torch's why CUDA is unusable (driver too old, ...)
        warnings.simplefilter("always")
        cuda, built = torch.cuda.is_available(), torch.version.cuda
    gpus = torch.cuda.device_count() if cuda else 0
    nccl, gloo = (dist.is_available() and ok() for ok in (dist.is_nccl_available, dist.is_gloo_available))
    facts = {
        "python": f"{platform.python_version()} ({sys.executable})",
        "torch": f"{torch.__version__}   lightning {lightning.__version__}   torchmetrics {torchmetrics.__version__}",
        "CUDA build": built or "no (CPU-only torch)",
        "cuda.is_available ": cuda,
    }
    for i, p in enumerate(map(torch.cuda.get_device_properties, range(gpus))):
        facts[f"  GPU {i}"] = f"{p.name}, {p.total_memory / 2**30:.1f} GiB, compute {p.major}.{p.minor}"
    if cuda:
        facts["bf16"] = torch.cuda.is_bf16_supported()
    facts["distributed"] = f"NCCL {nccl}, gloo {gloo}"
    workers, devices = init.get("num_workers"), str(trainer.get("devices", "auto"))
    if workers is None:  # only ImageFolder, or another data module's Dataset, reads files per sample
        procs = int(devices) if devices.isdigit() else gpus or 1
        workers = default_num_workers(source == "imagefolder" or not image_module, procs)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()  # its CPU set
    facts["CPUs"] = f"{cpus} usable; data loader workers per process: {workers}"
    run_dir = Path(config.get("run_dir") or "runs")
    try:  # the check `make train` runs before training: a real write, in the nearest existing folder
        check_writable(run_dir)
        oks.append(f"run directory {run_dir} is writable.")
    except ConfigError:
        stops.append(f"cannot write '{run_dir}'. fix: make it writable, or pass another --run_dir.")
    facts["run dir"] = f"{run_dir.resolve()} ({'writable' if oks else 'NOT writable'})"
    if not config:
        facts["config"] = "not read: see the problem below"
    else:
        logger = trainer.get("logger")
        if not isinstance(logger, list):
            logger = [{"class_path": "TensorBoardLogger"} if logger is True else logger] if logger else []
        loggers = dict.fromkeys(str(e.get("class_path")).rsplit(".", 1)[-1] for e in logger)
        facts["loggers"] = ", ".join(loggers) or "none"
        facts["data"], problem = check_data(data)
        if problem:
            stops.append(problem)
        elif image_module:
            oks.append(f"data ({source}) is present.")
        else:
            oks.append(f"data module {source} and the classes it names import.")
    print(*(f"{key:<13} {value}" for key, value in facts.items()), "", sep="\n")

    if (accel := str(trainer.get("accelerator", "auto"))) in ("gpu", "cuda") and not cuda:
        stops.append(
            f"accelerator '{accel}' needs a CUDA GPU; none is usable. fix: --trainer.accelerator auto."
        )
    elif not cuda:
        why = "CPU-only torch" if not built else caught and str(caught[0].message).strip() or "no GPU visible"
        oks.insert(0, f"no CUDA GPU ({why}); training runs on the CPU (fine for the default digits run).")
    else:
        oks.insert(0, f"{gpus} CUDA GPU(s) usable.")
    notes = ["several GPUs but no NCCL: DDP would be slow or fail. fix: install torch with NCCL."]
    notes = notes if gpus > 1 and not nccl else []
    verdict = f"{len(stops)} problem(s) would stop `make train`." if stops else "ready for `make train`."
    print(*(f"ok: {t}" for t in oks), *(f"problem (training still starts): {t}" for t in notes), sep="\n")
    print(*(f"problem: {t}" for t in stops), f"doctor: {verdict}", sep="\n")
    return 1 if stops else 0


def main(args: list[str]) -> None:
    if args[:1] in (["-h"], ["--help"]):
        print(__doc__)
    elif code := doctor(args):
        sys.exit(code)

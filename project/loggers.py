"""Logger choices resolved against the run directory: combinable overlays, each logger's save_dir, and W&B
online/offline + resume.

Overlays in configs/logger/ append with `logger+:`; `configure_loggers` then keeps one logger per class (the
last config's settings win), so `--config configs/logger/tensorboard.yaml` on top of the default is harmless.
"""

import netrc
import os
import secrets
import string
import sys
from pathlib import Path


def configure_loggers(loggers: list, run_dir: Path) -> list:
    """Deduplicate by class, and point each logger that has a save_dir at the run directory, as an absolute path.

    Absolute because TensorBoard's event writer appends from a background thread, resolving its path against the
    working directory at that moment, and jsonargparse changes the working directory while it reads a config file
    (LogConfig reads the defaults after fit): a relative save_dir made the writer fail with FileNotFoundError.
    """
    by_class: dict[str, object] = {}
    for logger in loggers:
        by_class[logger.class_path] = logger  # dicts keep the first position; the later config wins
    for logger in by_class.values():
        if "save_dir" in logger.init_args:
            logger.init_args.save_dir = str(Path(run_dir).absolute())
        if logger.class_path.endswith("WandbLogger"):
            configure_wandb(logger.init_args, run_dir)
    return list(by_class.values())


def configure_wandb(init_args, run_dir: Path) -> None:
    """The run directory's W&B id, an absolute save_dir, and offline mode when no API key is configured.

    save_dir is absolute: W&B's service process, once started by a first run in this process, outlives it and
    resolves a relative directory against its own working directory, not the caller's.
    Offline is asked for with W&B's own `mode="offline"`, not WandbLogger's `offline=True`: Lightning implements
    that flag by setting WANDB_MODE=dryrun in os.environ, which a second run in the same process (a notebook, a
    test, a sweep) would then read as the user's explicit choice.
    """
    init_args.save_dir = str(Path(run_dir).absolute())
    if init_args.get("id") is None and init_args.get("version") is None:
        init_args.id = wandb_run_id(run_dir)
    if os.environ.get("WANDB_MODE") or init_args.get("offline") or init_args.get("mode"):
        return  # the user chose a mode explicitly
    if not wandb_key_configured():
        init_args.mode = "offline"
        print(
            f"wandb: no API key (WANDB_API_KEY or `wandb login`), so logging offline to {run_dir}/wandb. "
            f"Upload later with: wandb sync {run_dir}/wandb/offline-run-*",
            file=sys.stderr,
            flush=True,
        )


def wandb_run_id(run_dir: Path) -> str:
    """The W&B id of the run that last logged into this run directory (a resume continues it), else a new one.

    Read back from the folders W&B itself writes, `<run dir>/wandb/[offline-]run-<YYYYmmdd_HHMMSS>-<id>`, so that
    nothing is written before the run starts: a start that fails leaves no directory behind. Only rank 0 opens the
    W&B run (WandbLogger's experiment is rank-zero-only), so the ids the other ranks draw are never used.
    """
    folders = [p for p in Path(run_dir, "wandb").glob("*run-*-*") if p.is_dir() and not p.is_symlink()]
    if folders:
        newest = max(folders, key=lambda p: p.name.rsplit("-", 2)[-2])  # by the timestamp in the name
        return newest.name.rsplit("-", 1)[1]
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def wandb_key_configured() -> bool:
    """True when W&B can authenticate: WANDB_API_KEY, or credentials that `wandb login` saved in ~/.netrc."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].split("/")[0]
    path = os.environ.get("NETRC", str(Path.home() / ".netrc"))
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False

"""The config's loggers pointed at the run directory; W&B offline without a key, and resumed with its run."""

import netrc
import os
import secrets
import string
import sys
from pathlib import Path


def configure_loggers(loggers: list, run_dir: Path) -> list:
    """One logger per class (overlays append with `logger+:`; the later one wins), each save_dir the run directory,
    absolute: TensorBoard's writer thread resolves a relative one in the working directory of the moment."""
    by_class = {logger.class_path: logger for logger in loggers}  # a dict keeps the first position
    for logger in by_class.values():
        if "save_dir" in logger.init_args:
            logger.init_args.save_dir = str(Path(run_dir).absolute())
        if logger.class_path.endswith("WandbLogger"):
            configure_wandb(logger.init_args, run_dir)
    return list(by_class.values())


def configure_wandb(init_args, run_dir: Path) -> None:
    """The run directory's W&B id, and without an API key W&B's own `mode="offline"`: WandbLogger's `offline=True`
    sets WANDB_MODE in os.environ, which a second run in the process would read as the user's."""
    init_args.save_dir = str(Path(run_dir).absolute())
    if init_args.get("id") is None and init_args.get("version") is None:
        init_args.id = wandb_run_id(run_dir)
    if os.environ.get("WANDB_MODE") or init_args.get("offline") or init_args.get("mode"):
        return  # the user chose a mode explicitly
    if not wandb_key_configured():
        init_args.mode = "offline"
        sys.stderr.write(
            f"wandb: no API key (WANDB_API_KEY or `wandb login`), so logging offline to {run_dir}/wandb. "
            f"Upload later with: wandb sync {run_dir}/wandb/offline-run-*\n"
        )


def wandb_run_id(run_dir: Path) -> str:
    """The id of the W&B run that last logged into this run directory (a resume continues it), read from W&B's own
    `<run dir>/wandb/[offline-]run-<YYYYmmdd_HHMMSS>-<id>`; else a new one (only rank 0's is used)."""
    folders = [p for p in Path(run_dir, "wandb").glob("*run-*-*") if p.is_dir() and not p.is_symlink()]
    if folders:  # the newest, by the timestamp in its name
        return max(folders, key=lambda p: p.name.rsplit("-", 2)[-2]).name.rsplit("-", 1)[1]
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def wandb_key_configured() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].split("/")[0]
    try:
        return netrc.netrc(os.environ.get("NETRC", Path.home() / ".netrc")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False

"""Logger choices resolved against the run directory: combinable overlays, and W&B online/offline + resume.

Overlays in configs/logger/ append with `logger+:`; `configure_loggers` then keeps one logger per class (the
last config's settings win), so `--config configs/logger/tensorboard.yaml` on top of the default is harmless.
"""

import netrc
import os
import secrets
import string
import sys
import time
from pathlib import Path

WANDB_ID_FILE = "wandb_id.txt"  # lets a resumed run (same run dir) continue the same W&B run


def configure_loggers(loggers: list, run_dir: Path) -> list:
    """Deduplicate by class and fill in what depends on the run dir (save_dir is set by the CLI)."""
    by_class: dict[str, object] = {}
    for logger in loggers:
        by_class[logger.class_path] = logger  # dicts keep the first position; the later config wins
    for logger in by_class.values():
        if logger.class_path.endswith("WandbLogger"):
            configure_wandb(logger.init_args, run_dir)
    return list(by_class.values())


def configure_wandb(init_args, run_dir: Path) -> None:
    if init_args.get("id") is None and init_args.get("version") is None:
        init_args.id = wandb_run_id(run_dir)
    if os.environ.get("WANDB_MODE") or init_args.get("offline"):
        return  # the user chose a mode explicitly
    if not wandb_key_configured():
        init_args.offline = True
        print(
            f"wandb: no API key (WANDB_API_KEY or `wandb login`), so logging offline to {run_dir}/wandb. "
            f"Upload later with: wandb sync {run_dir}/wandb/offline-run-*",
            file=sys.stderr,
            flush=True,
        )


def wandb_run_id(run_dir: Path) -> str:
    """The run dir's W&B id: read back when the run dir is reused (resume), else created and stored."""
    path = Path(run_dir) / WANDB_ID_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    new = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
    try:
        with path.open("x") as fh:  # exclusive create: concurrent ranks agree on the first id written
            fh.write(new + "\n")
    except FileExistsError:
        pass
    for _ in range(100):  # another rank may have created the file and not yet written its id into it
        if run_id := path.read_text().strip():
            return run_id
        time.sleep(0.01)
    path.write_text(new + "\n")  # still empty after 1 s: its writer died between creating and writing it
    return new


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

"""One tiny trained run shared by the tool tests (loggers, report, predict, export): trained once per `make test`.

Default config + configs/debug/limit_batches.yaml (2 epochs x 5 batches) + the W&B overlay, offline, in the process
of the first pytest-xdist worker that needs it (tests/conftest.py's once_per_session, as for `finished_run`); the
other workers read it. Do not write into it. Nothing else is turned off: progress bar and model summary run as
under `make train`. (The session's `make train` run itself, as a subprocess without W&B, is `finished_run`.)
"""

from pathlib import Path

import pytest

from tests.conftest import CONFIGS, once_per_session, run_cli

# A fake key: W&B must not write it anywhere (WANDB_MODE=offline keeps W&B off the network).
FAKE_WANDB_KEY = "sentinel0123456789abcdef0123456789abcdef"


def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    def train(root: Path) -> dict:
        with pytest.MonkeyPatch.context() as mp:
            mp.chdir(root)
            mp.setenv("WANDB_MODE", "offline")
            mp.setenv("WANDB_API_KEY", FAKE_WANDB_KEY)
            for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):  # keep ~ clean
                mp.setenv(var, str(root / "wandb-home"))
            code = run_cli(
                "fit",
                "--config",
                CONFIGS / "debug/limit_batches.yaml",
                "--config",
                CONFIGS / "logger/wandb.yaml",
                "--run_dir",
                root / "run",
            )
        assert code == 0
        return {"run": str(root / "run")}

    return Path(once_per_session(tmp_path_factory, "trained-run", train)["run"])

"""What a run prints: Lightning's advertising tips are dropped (project/console.py), and `make train` in a
terminal leaves one bar per epoch, and the run directory on its last line."""

import logging
import re
from pathlib import Path

import pytest

from project.console import drop_inapplicable_messages
from tests.conftest import Launch, launch, make_argv, screen, user_checkout


def test_tips_are_dropped_and_other_lightning_info_kept():
    printed = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            printed.append(record.getMessage())

    parent, handler = logging.getLogger("lightning.pytorch"), Collect()
    level = parent.level
    parent.addHandler(handler)
    parent.setLevel(logging.INFO)  # as Lightning sets it on import
    try:
        drop_inapplicable_messages()
        drop_inapplicable_messages()  # every CLI call runs it: filters are not stacked
        # where Lightning's rank_zero_info logs (a child logger: its records reach the parent's handlers)
        child = logging.getLogger("lightning.pytorch.utilities.rank_zero")
        child.info("💡 Tip: For seamless cloud logging and experiment tracking, try installing [litlogger]")
        child.info("GPU available: False, used: False")
    finally:
        parent.removeHandler(handler)
        parent.setLevel(level)
    assert printed == ["GPU available: False, used: False"]
    assert sum(getattr(f, "__name__", "") == "_drop_tips" for f in handler.filters) == 1


# -- What `make train` leaves on a terminal ------------------------------------------------------------------------
# The README's commands in a pseudo-terminal (120 x 40), as typed; only epochs and batches shrink. The screen is
# what the terminal shows at the end: Rich redraws its live bar in place (carriage returns, cursor-up, erase-line),
# so the raw bytes hold every frame and only replaying them tells what stays on screen.

TERMINAL = {"TERM": "xterm-256color", "OMP_NUM_THREADS": "1"}


def terminal_run(
    tmp_path: Path, command: str, *args: str, env: dict | None = None
) -> tuple[Launch, list[str]]:
    """`command`, a documented `make` line, with `args` added to its ARGS, in a terminal: the launch and screen."""
    checkout = user_checkout(tmp_path)
    result = launch(make_argv(command, *args), checkout, env={**TERMINAL, **(env or {})}, terminal=True)
    assert result.returncode == 0 and len(result.runs()) == 1, result
    return result, screen(result.raw)


@pytest.fixture(scope="module")
def make_train(tmp_path_factory) -> tuple[Launch, list[str]]:
    """The W&B recipe's command (docs/recipes.md, "Loggers"), `make train ARGS="--config configs/logger/wandb.yaml"`,
    for 2 epochs in a terminal: the launch and its final screen. W&B offline without a key; its service and settings
    kept in the test's folder, and it could not reach a server. Every logger of a run draws on one screen here."""
    tmp = tmp_path_factory.mktemp("terminal")
    env = {"WANDB_API_KEY": None, "WANDB_MODE": None, "NETRC": str(tmp / "no-netrc")}
    env |= {var: str(tmp / "wandb-home") for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR")}
    env |= {"WANDB_BASE_URL": "http://127.0.0.1:9"}
    command = 'make train ARGS="--config configs/logger/wandb.yaml"'
    return terminal_run(tmp / "checkout", command, "--trainer.max_epochs 2", env=env)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_last_epoch_bar_is_on_screen_once(make_train):
    # Lightning logs "`Trainer.fit` stopped: ..." while the last epoch's bar is live; written past Rich, it left
    # the bar's first line on screen and the bar was drawn again below it.
    result, lines = make_train
    bars = [line for line in lines if line.startswith("Epoch 1/1")]
    assert len(bars) == 1, "\n".join(lines)
    assert re.search(r" 20/20 ", bars[0]), bars
    stopped = [i for i, line in enumerate(lines) if "`Trainer.fit` stopped: `max_epochs=2` reached." in line]
    assert len(stopped) == 1 and lines.index(bars[0]) > stopped[0], "\n".join(lines)  # printed above the bar


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_wandb_offline_run_directory_is_still_the_last_line(make_train):
    result, lines = make_train
    (run,) = result.runs()
    assert lines[-1] == f"Run directory: runs/{run.name}", "\n".join(lines[-20:])
    # W&B's footer (its run history and the command that uploads the run) printed before the summary table.
    sync = [
        i
        for i, line in enumerate(lines)
        if re.search(rf"wandb sync \S*runs/{run.name}/wandb/offline-run-", line)
    ]
    table = max(i for i, line in enumerate(lines) if "Run summary" in line)
    assert sync and sync[-1] < table, "\n".join(lines[-40:])

"""Shared test helpers: run the CLI in-process inside a temporary working directory."""

import json
import os
from pathlib import Path

import pytest

from project.cli import main
from project.run_dir import RUN_DIR_ENV

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "configs"
# Fast, quiet training flags for end-to-end tests.
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--claim",
        action="append",
        default=[],
        metavar="ID",
        help="run only the tests marked @pytest.mark.claim(ID) (repeatable); scripts/mutate.py uses it",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wanted = set(config.getoption("--claim"))
    if not wanted:
        return
    keep, drop = [], []
    for item in items:
        ids = {i for mark in item.iter_markers("claim") for i in mark.args}
        (keep if ids & wanted else drop).append(item)
    config.hook.pytest_deselected(items=drop)
    items[:] = keep


def run_cli(*args: str) -> int:
    """Run `python -m project ...` in this process; return the exit code (0 when it returns normally)."""
    try:
        main([str(a) for a in args])
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 1
    finally:
        os.environ.pop(RUN_DIR_ENV, None)
    return 0


def read_summary(run_dir: Path) -> dict:
    return json.loads((Path(run_dir) / "summary.json").read_text())


@pytest.fixture
def in_tmp(tmp_path, monkeypatch) -> Path:
    """Run from an empty directory, so runs/ lands in tmp_path."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(RUN_DIR_ENV, raising=False)
    return tmp_path

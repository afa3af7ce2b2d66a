"""Kill -9 at random moments (mid-epoch, validation, checkpoint writes), resume from `last` each time: the end
result is bit-identical to an uninterrupted run. scripts/kill_resume.py --kills 20 is the stronger check."""

import importlib.util

import pytest

from tests.conftest import CONFIGS, REPO, run_cli

pytestmark = pytest.mark.slow

spec = importlib.util.spec_from_file_location("kill_resume", REPO / "scripts/kill_resume.py")
kill_resume = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kill_resume)


@pytest.mark.timeout(600)  # 6 process starts of ~7 s imports each, more on a loaded machine
def test_five_kill_9s_in_one_run_end_bit_identical(tmp_path):
    reference = tmp_path / "reference"  # in-process: saves one ~7 s subprocess start
    assert (
        run_cli("fit", "--config", CONFIGS / "default.yaml", *kill_resume.FLAGS, "--run_dir", reference) == 0
    )
    result = kill_resume.kill_resume(tmp_path, kills=5, seed=1, timeout=150, reference=reference)
    assert len(result["kills"]) == 5
    assert result["problems"] == []

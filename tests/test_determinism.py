"""Same seed, two fresh runs: bit-identical weights on CPU (deterministic: true) and the same summary.json
accuracies; another seed: different weights."""

import pytest
import torch

from tests.conftest import QUIET, read_summary, run_cli

pytestmark = pytest.mark.slow
FLAGS = [
    *QUIET,
    "--trainer.max_epochs",
    "1",
    "--trainer.limit_train_batches",
    "4",
    "--trainer.limit_val_batches",
    "1",
    "--trainer.limit_test_batches",
    "2",
]


def train(run_dir, seed: int, *extra: str) -> dict:
    assert run_cli("fit", *FLAGS, "--seed_everything", seed, "--run_dir", run_dir, *extra) == 0
    return torch.load(run_dir / "checkpoints/last.ckpt", map_location="cpu", weights_only=True)["state_dict"]


@pytest.mark.claim("same-seed-bit-identical", "same-seed-same-accuracies")
def test_same_seed_same_weights_other_seed_other_weights(tmp_path, caplog):
    a, b = train(tmp_path / "a", 7), train(tmp_path / "b", 7)
    c = train(tmp_path / "c", 8, "--test_after_fit", "false")
    assert all(torch.equal(a[k], b[k]) for k in a)
    keys = ["best_val_acc", "test_acc", "test_loss"]
    assert [read_summary(tmp_path / "a")[k] for k in keys] == [read_summary(tmp_path / "b")[k] for k in keys]
    assert not all(torch.equal(a[k], c[k]) for k in a if k.endswith("weight"))
    assert "Seed set to 7" in caplog.text  # printed by Lightning's seed_everything
    assert read_summary(tmp_path / "a")["seed"] == 7
    assert "seed_everything: 7" in (tmp_path / "a/config.yaml").read_text()  # and saved with the run

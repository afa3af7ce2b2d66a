"""Same seed, two fresh runs: bit-identical weights on CPU (deterministic: true); another seed: different."""

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
    "--test_after_fit",
    "false",
]


def train(run_dir, seed: int) -> dict:
    assert run_cli("fit", *FLAGS, "--seed_everything", seed, "--run_dir", run_dir) == 0
    return torch.load(run_dir / "checkpoints/last.ckpt", map_location="cpu", weights_only=True)["state_dict"]


@pytest.mark.claim("same-seed-bit-identical")
def test_same_seed_same_weights_other_seed_other_weights(tmp_path, caplog):
    a, b, c = train(tmp_path / "a", 7), train(tmp_path / "b", 7), train(tmp_path / "c", 8)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a if k.endswith("weight"))
    assert "Seed set to 7" in caplog.text  # printed by Lightning's seed_everything
    assert read_summary(tmp_path / "a")["seed"] == 7
    assert "seed_everything: 7" in (tmp_path / "a/config.yaml").read_text()  # and saved with the run

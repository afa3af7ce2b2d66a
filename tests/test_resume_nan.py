"""A NaN or inf loss stops the run with a message naming the step; the last checkpoint stays finite."""

import pytest
import torch

from project.module import ClassificationModule
from tests.conftest import QUIET, run_cli

pytestmark = pytest.mark.slow


class NaNAtStep(ClassificationModule):
    """Returns a NaN (or inf) loss at one optimizer step, as a diverging run would."""

    def __init__(self, *args, nan_at_step: int = 4, bad_value: str = "nan", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.nan_at_step = nan_at_step
        self.bad_value = float(bad_value)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        # The loss is > 0, so times inf it is inf.
        return loss * self.bad_value if self.global_step == self.nan_at_step else loss


@pytest.mark.claim("nan-loss-stops-run")
@pytest.mark.parametrize("bad_value", ["nan", "inf"])
def test_nan_loss_stops_with_where_and_keeps_last_good_checkpoint(in_tmp, capsys, bad_value):
    code = run_cli(
        "fit",
        *QUIET,
        "--trainer.max_epochs",
        "3",
        "--trainer.limit_train_batches",
        "3",
        "--trainer.limit_val_batches",
        "1",
        "--checkpoint_every_n_steps",
        "1",
        "--run_dir",
        "r",
        "--model.class_path",
        "tests.test_resume_nan.NaNAtStep",
        "--model.init_args.nan_at_step",
        "4",
        "--model.init_args.bad_value",
        bad_value,
    )
    err = capsys.readouterr().err
    assert code == 2
    # The NaN of step 4 is found at the check before step 5's checkpoint is written.
    assert "became NaN or inf by global step 5, epoch 1;" in " ".join(err.split())
    assert "detect_anomaly.yaml" in err
    last = torch.load(in_tmp / "r/checkpoints/last.ckpt", map_location="cpu", weights_only=True)
    assert last["global_step"] == 4  # written after step 4 (the last good one), never after the NaN
    assert all(torch.isfinite(t).all() for t in last["state_dict"].values() if t.is_floating_point())

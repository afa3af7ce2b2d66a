"""RunReport: report.png after fit + test, with every panel drawn."""

import numpy as np
import pytest
from PIL import Image

from tests.trained_run import trained_run


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return trained_run(tmp_path_factory)


def test_report_png(run_dir):
    image = np.asarray(Image.open(run_dir / "report.png").convert("RGB"))
    assert image.shape == (800, 1200, 3)  # 15 x 10 inches at dpi 80
    assert image.std() > 20  # not blank
    # The confusion matrix (blue) and the wrong examples (grey images) are both there.
    blue = (image[..., 2].astype(int) - image[..., 0]) > 60
    assert blue[400:].mean() > 0.01
    dark = image.max(axis=-1) < 40
    assert dark[400:, 600:].mean() > 0.02


def test_report_works_without_test_results():
    from project.callbacks.report import render

    image = render(
        {0: {"train/loss": 2.0, "val/loss": 1.9}, 1: {"train/loss": 1.5}}, [[0.1], [0.2]], None, [], None, 50
    )
    assert image.shape == (500, 750, 3) and image.std() > 5


def test_report_history_survives_checkpoint_restore():
    from project.callbacks.report import RunReport

    resumed = RunReport()  # a resumed fit: the checkpoint holds epochs 0-1, this process adds epoch 2
    resumed.load_state_dict(
        {"epochs": {0: {"val/acc": 0.1}, 1: {"val/acc": 0.2}}, "lrs": {0: [1e-3], 5: [2e-3]}}
    )
    resumed.epochs[2], resumed.lrs[10] = {"val/acc": 0.3}, [1e-4]
    state = resumed.state_dict()
    assert sorted(state["epochs"]) == [0, 1, 2] and sorted(state["lrs"]) == [0, 5, 10]
    # The test after fit restores the best (earlier) checkpoint: the epochs seen in this process win.
    resumed.load_state_dict({"epochs": {0: {"val/acc": 0.1}}, "lrs": {0: [1e-3]}})
    assert resumed.state_dict()["epochs"][2] == {"val/acc": 0.3}

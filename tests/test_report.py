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

    image = render({0: {"train/loss": 2.0, "val/loss": 1.9}, 1: {"train/loss": 1.5}}, [[0.1], [0.2]], None, [], None, 50)
    assert image.shape == (500, 750, 3) and image.std() > 5

"""Checkpoints in object storage (moto's S3 server, tests/test_streaming.py's fixture): the run's checkpoint
directory is s3://my-bucket/run/checkpoints, its logs stay local, and the starting command re-run on a machine without the
run's local directory continues from the bucket and ends bit-identical to an undisturbed run."""

import shutil

import pytest
import torch
import yaml

from project.checkpoint import read_checkpoint
from project.checkpoint_io import AtomicCheckpointIO
from tests.conftest import CONFIGS, run_cli
from tests.test_resume import FLAGS, add
from tests.test_streaming import s3  # noqa: F401 - the fixture

pytestmark = pytest.mark.slow
URL = "s3://my-bucket/run/checkpoints"


@pytest.mark.claim("checkpoints-in-object-storage")
def test_checkpoints_in_s3_resume_bit_identical(s3, in_tmp, monkeypatch):  # noqa: F811
    for name, value in {**s3, "AWS_ALLOW_HTTP": "true"}.items():  # obstore reaches moto's http://
        monkeypatch.setenv(name, value)
    config = yaml.safe_load((CONFIGS / "default.yaml").read_text())
    (keep,) = [c for c in config["trainer"]["callbacks"] if c["class_path"].endswith("RunCheckpoint")]
    keep["init_args"]["dirpath"] = URL
    (in_tmp / "s3.yaml").write_text(
        yaml.safe_dump({"trainer": {"callbacks": config["trainer"]["callbacks"]}})
    )
    overlay = ("--config", CONFIGS / "default.yaml", "--config", in_tmp / "s3.yaml")

    assert run_cli("fit", *FLAGS, "--run_dir", "runs/ref") == 0
    assert run_cli("fit", *overlay, *FLAGS, "--run_dir", "runs/a", add("StopAfterEpoch", epoch=2)) == 99
    assert read_checkpoint(f"{URL}/last.ckpt")["epoch"] == 1
    assert not (in_tmp / "runs/a/checkpoints").exists()
    # Another machine (no local run directory) continues the run with the starting command, from the bucket.
    shutil.rmtree(in_tmp / "runs/a")
    assert run_cli("fit", *overlay, *FLAGS, "--run_dir", "runs/a") == 0
    assert "s3://" in (in_tmp / "runs/a/resumes.jsonl").read_text()
    ours, ref = (
        read_checkpoint(f"{URL}/last.ckpt"),
        read_checkpoint(in_tmp / "runs/ref/checkpoints/last.ckpt"),
    )
    assert ours["global_step"] == ref["global_step"] == 12
    assert all(torch.equal(ours["state_dict"][k], v) for k, v in ref["state_dict"].items())
    assert (in_tmp / "runs/a/config.yaml").is_file() and not (in_tmp / "runs/a/checkpoints").exists()
    # A checkpoint that fails to serialise never reaches the bucket: the object there stays the previous one.
    with pytest.raises(Exception):  # noqa: B017 - pickle's error for a lambda
        AtomicCheckpointIO().save_checkpoint({"state_dict": {}, "code": lambda: 0}, f"{URL}/last.ckpt")
    assert read_checkpoint(f"{URL}/last.ckpt")["global_step"] == 12

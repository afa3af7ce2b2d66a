"""Bad input fails early as one paragraph naming what, where and the fix; files left behind are checked."""

import errno

import pytest
import torch
from PIL import Image

from project.checkpoint import AtomicCheckpointIO, load_weights
from project.errors import ConfigError
from project.module import ClassificationModule
from tests.conftest import QUIET, run_cli

TINY = [
    *QUIET,
    "--trainer.max_epochs",
    "1",
    "--trainer.limit_train_batches",
    "1",
    "--trainer.limit_val_batches",
    "1",
    "--test_after_fit",
    "false",
]
WIDTH = "--model.init_args.model.init_args.width"


def fails(capsys, *args) -> str:
    assert run_cli("fit", *TINY, *args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return " ".join(err.split())  # one paragraph, whitespace-normalised for matching


# --- data -------------------------------------------------------------------------------------------------


def image_folder(root, bad: dict[str, bytes]):
    for cls in ("cat", "dog"):
        (root / "train" / cls).mkdir(parents=True)
        for i in range(6):
            Image.new("RGB", (8, 8), (40 * i, 0, 0)).save(root / "train" / cls / f"{i}.png")
    for name, content in bad.items():
        (root / "train" / name).write_bytes(content)


def test_corrupt_and_non_image_files_fail_before_training_listing_them(in_tmp, capsys):
    good = in_tmp / "ok.png"
    Image.new("RGB", (8, 8)).save(good)
    image_folder(
        in_tmp / "imgs", {"cat/truncated.png": good.read_bytes()[:40], "dog/notes.png": b"not an image"}
    )
    err = fails(
        capsys,
        "--data.init_args.source",
        "imagefolder",
        "--data.init_args.root",
        in_tmp / "imgs",
        "--data.init_args.batch_size",
        "2",
        "--run_dir",
        "r",
    )
    assert "2 of 14 files under" in err and "not readable images" in err
    assert "cat/truncated.png" in err and "dog/notes.png" in err and "Delete or replace them" in err
    assert not (in_tmp / "r/checkpoints").exists()


def test_labels_out_of_range(in_tmp, capsys, monkeypatch):
    from project.data import digits

    real = digits.load_digits_tensors

    def shifted():
        images, labels = real()
        labels[:3] = 12  # a label the 10-class data cannot have
        return images, labels

    monkeypatch.setattr(digits, "load_digits_tensors", shifted)
    err = fails(capsys, "--run_dir", "r")
    assert "labels outside 0..9" in err and "[12]" in err and "10 classes" in err
    assert not (in_tmp / "r/checkpoints").exists()


def test_empty_split_after_carving(in_tmp, capsys):
    err = fails(capsys, "--data.init_args.val_fraction", "0", "--run_dir", "r")
    assert "The val split is empty" in err and "val=0" in err and "--data.init_args.val_fraction" in err


def test_batch_larger_than_training_split(in_tmp, capsys):
    err = fails(capsys, "--data.init_args.batch_size", "5000", "--run_dir", "r")
    assert "fewer than data.batch_size=5000" in err and "--data.init_args.batch_size" in err
    assert not (in_tmp / "r/checkpoints").exists()


# --- checkpoints --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ckpt") / "run"
    assert run_cli("fit", *TINY, WIDTH, "8", "--run_dir", run_dir) == 0
    return run_dir / "checkpoints/last.ckpt"


def test_template_checkpoints_load_with_weights_only(checkpoint):
    state = load_weights(checkpoint)
    assert state["model.head.1.weight"].shape == (10, 16)  # ConvNet(width=8): head Linear(16, 10)


def test_checkpoint_of_another_architecture(checkpoint, in_tmp, capsys):
    # LightningCLI rebuilds the model from the checkpoint's saved hyperparameters, so a mismatch needs a
    # checkpoint without them (written outside the CLI, or edited).
    ckpt = torch.load(checkpoint, weights_only=True)
    ckpt["hyper_parameters"] = {}
    torch.save(ckpt, in_tmp / "bare.ckpt")
    err = fails(capsys, WIDTH, "16", "--ckpt_path", in_tmp / "bare.ckpt", "--run_dir", "r")
    assert (
        f"Checkpoint '{in_tmp / 'bare.ckpt'}' was written by a different model" in err
        and "differ in shape" in err
    )
    assert "config.yaml" in err


def test_checkpoint_with_other_classes(checkpoint, in_tmp, capsys):
    ckpt = torch.load(checkpoint, weights_only=False)
    head = [k for k, v in ckpt["state_dict"].items() if v.ndim >= 1 and v.shape[0] == 10 and "acc" not in k]
    for k in head:  # as if trained on 5 classes
        ckpt["state_dict"][k] = ckpt["state_dict"][k][:5]
    torch.save(ckpt, in_tmp / "five.ckpt")
    err = fails(capsys, WIDTH, "8", "--ckpt_path", in_tmp / "five.ckpt", "--run_dir", "r")
    assert "different number of classes" in err and "checkpoint (5" in err and "model (10" in err


def test_truncated_checkpoint(checkpoint, in_tmp, capsys):
    data = checkpoint.read_bytes()
    (in_tmp / "cut.ckpt").write_bytes(data[: len(data) // 2])
    err = fails(capsys, WIDTH, "8", "--ckpt_path", in_tmp / "cut.ckpt", "--run_dir", "r")
    assert (
        f"Checkpoint '{in_tmp / 'cut.ckpt'}'" in err
        and "cannot be read" in err
        and "truncated, corrupt" in err
    )


def test_foreign_checkpoint(in_tmp, capsys):
    torch.save({"weights": torch.zeros(3)}, in_tmp / "other.pt")
    err = fails(capsys, "--ckpt_path", in_tmp / "other.pt", "--run_dir", "r")
    assert "not a Lightning checkpoint of this template" in err and "weights" in err


# --- disk --------------------------------------------------------------------------------------------------


def test_run_dir_not_writable(in_tmp, capsys):
    (in_tmp / "afile").write_text("")
    err = fails(capsys, "--run_dir", in_tmp / "afile/run")
    assert "is not writable" in err and "--run_dir" in err


@pytest.mark.parametrize("failure", ["disk full", "killed"])
def test_failed_checkpoint_write_keeps_the_previous_one(tmp_path, monkeypatch, failure):
    io, path = AtomicCheckpointIO(), tmp_path / "last.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}}, path)

    def broken_save(obj, f):
        f.write(b"half a checkpoint")
        if failure == "disk full":
            raise OSError(errno.ENOSPC, "No space left on device")
        raise KeyboardInterrupt  # stands in for the process dying mid-write

    monkeypatch.setattr(torch, "save", broken_save)
    expected = ConfigError if failure == "disk full" else KeyboardInterrupt
    with pytest.raises(expected) as info:
        io.save_checkpoint({"state_dict": {"w": torch.zeros(2)}}, path)
    if failure == "disk full":
        assert "No space left on device" in str(info.value) and "previous 'last.ckpt' is untouched" in str(
            info.value
        )
    monkeypatch.undo()
    assert torch.equal(load_weights(path)["w"], torch.ones(2))
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # no temporary file left


# --- memory ------------------------------------------------------------------------------------------------


class OOMModule(ClassificationModule):
    def training_step(self, batch, batch_idx):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_out_of_memory_names_the_batch_size_flag(in_tmp, capsys):
    err = fails(capsys, "--model.class_path", "tests.test_bad_input.OOMModule", "--run_dir", "r")
    assert (
        "out of GPU memory" in err
        and "--data.init_args.batch_size" in err
        and "Tried to allocate 2.00 GiB" in err
    )


def test_missing_checkpoint_file(in_tmp, capsys):
    err = fails(capsys, "--ckpt_path", in_tmp / "nope.ckpt", "--run_dir", "r")
    assert "does not exist" in err

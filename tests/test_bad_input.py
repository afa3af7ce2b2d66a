"""Bad input fails early as one paragraph naming what, where and the fix (exit code 2), and leaves nothing behind.

Every case runs the CLI in-process from an empty working directory (in_tmp) and goes through `fails()`, which
also checks the README's "no run directory is left behind": the working directory holds exactly what the test
put there before the run. The two cases that stop a run after training began (out of memory, a full disk) keep
their run directory, as the README says, and check what is in it instead.
"""

import errno
import os
import subprocess
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from PIL import Image

from project.checkpoint import read_checkpoint
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


def files_under(root: Path) -> set[Path]:
    # An ImageFolder's index (<root>/.project-index, project/data/folder_index.py) is kept even when the data
    # fails: it is a cache of the data's checks, not run output, and saves the next start re-checking them.
    return {p.relative_to(root) for p in root.rglob("*") if ".project-index" not in p.parts}


def fails(capsys, *args, started: bool = False) -> str:
    """Run `fit` with bad input; assert exit code 2, one paragraph without a traceback, and no leftovers.

    started=True: the run stopped after training began; its run directory may stay (checked by the caller).
    """
    cwd = Path.cwd()
    before = files_under(cwd)
    capsys.readouterr()
    assert run_cli("fit", *TINY, *args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("error:") == 1, err
    left = files_under(cwd) - before
    if not started:
        assert not left, f"bad input left files behind: {sorted(map(str, left))}"
    return " ".join(err.split())  # one paragraph, whitespace-normalised for matching


# --- config and model --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, expected",
    [
        pytest.param(
            ["--data.init_args.source", "imagefolder", "--data.init_args.root", "nowhere"],
            ["'nowhere' does not exist", "--data.init_args.root"],
            id="missing data root",
            marks=pytest.mark.claim("bad-input-one-paragraph", "bad-input-data-root"),
        ),
        pytest.param(
            ["--model.init_args.lrr", "0.1"],
            [
                "--model.init_args.lrr: project.module.ClassificationModule takes no argument 'lrr'",
                "fit --help",
            ],
            id="unknown key",
            marks=pytest.mark.claim("bad-input-one-paragraph", "bad-input-config-key"),
        ),
        pytest.param(
            ["--data.init_args.batch_sise", "32"],
            ["takes no argument 'batch_sise'. Did you mean 'batch_size'?"],
            id="misspelled key",
            marks=pytest.mark.claim("bad-input-one-paragraph", "bad-input-config-key"),
        ),
        pytest.param(
            ["--model.init_args.model.init_args.widht", "8"],
            [
                "--model.init_args.model.init_args.widht: project.models.ConvNet takes no argument 'widht'. Did you mean 'width'?"
            ],
            id="misspelled nested key",
            marks=pytest.mark.claim("bad-input-one-paragraph", "bad-input-config-key"),
        ),
        pytest.param(
            ["--model.init_args.optimizer.init_args.lrr", "0.1"],
            [
                "--model.init_args.optimizer.init_args.lrr: torch.optim.AdamW takes no argument 'lrr'. Did you mean 'lr'?"
            ],
            id="misspelled optimizer key",
            marks=pytest.mark.claim("bad-input-one-paragraph", "bad-input-config-key"),
        ),
        pytest.param(
            ["--trainer.max_epoks", "3"],
            ["--trainer.max_epoks: no such key. Did you mean --trainer.max_epochs?"],
            id="misspelled trainer key",
            marks=pytest.mark.claim("bad-input-one-paragraph", "bad-input-config-key"),
        ),
        pytest.param(
            # (not my_models: tests/test_cli.py puts a my_models.py on the path of the process it runs in)
            ["--model.init_args.model", "not_on_the_path.TinyMLP"],
            [
                "--model.init_args.model not_on_the_path.TinyMLP: no module named 'not_on_the_path'",
                "PYTHONPATH",
            ],
            id="class path without module",
            marks=pytest.mark.claim("bad-input-one-paragraph", "bad-input-config-key"),
        ),
        pytest.param(
            ["--model.init_args.model", "project.models.ConvNett"],
            ["has no 'ConvNett'. Did you mean project.models.ConvNet?"],
            id="misspelled class",
            marks=pytest.mark.claim("bad-input-one-paragraph", "bad-input-config-key"),
        ),
        pytest.param(
            ["--data.init_args.batch_size", "abc"],
            ["batch_size", "Expected a <class 'int'>"],
            id="wrong type",
            marks=pytest.mark.claim("bad-input-one-paragraph", "bad-input-config-key"),
        ),
        pytest.param(
            # A model without a num_classes argument is not linked; Flatten maps (1, 8, 8) to 64 "logits".
            ["--model.init_args.model", "torch.nn.Flatten"],
            ["shape (2, 64)", "10 classes"],
            id="head size mismatch",
            marks=pytest.mark.claim("bad-input-one-paragraph", "bad-input-head-size"),
        ),
    ],
)
def test_bad_config_is_one_clear_paragraph(in_tmp, capsys, args, expected):
    err = fails(capsys, *args)
    assert "usage:" not in err
    for text in expected:
        assert text in err


# --- data -------------------------------------------------------------------------------------------------


def image_folder(root, bad: dict[str, bytes], classes=("cat", "dog")):
    for cls in classes:
        (root / "train" / cls).mkdir(parents=True)
        for i in range(6):
            Image.new("RGB", (8, 8), (40 * i, 0, 0)).save(root / "train" / cls / f"{i}.png")
    for name, content in bad.items():
        (root / "train" / name).write_bytes(content)


def imagefolder_args(root) -> list:
    return [
        "--data.init_args.source",
        "imagefolder",
        "--data.init_args.root",
        root,
        "--data.init_args.batch_size",
        "2",
    ]


@pytest.mark.claim("bad-input-one-paragraph", "bad-input-data-root")
def test_image_folder_without_class_folders_or_images(in_tmp, capsys):
    (in_tmp / "empty/train").mkdir(parents=True)
    err = fails(capsys, *imagefolder_args(in_tmp / "empty"), "--run_dir", "r")
    assert f"'{in_tmp / 'empty/train'}' has no class folders" in err and "one folder per class" in err
    (in_tmp / "noimg/train/cat").mkdir(parents=True)
    (in_tmp / "noimg/train/cat/notes.txt").write_text("not an image")
    err = fails(capsys, *imagefolder_args(in_tmp / "noimg"), "--run_dir", "r")
    assert "has class folders ['cat'] but no images" in err and ".png" in err


@pytest.mark.claim("bad-input-one-paragraph", "bad-input-unreadable-images")
def test_corrupt_and_non_image_files_fail_before_training_listing_them(in_tmp, capsys):
    good = in_tmp / "ok.png"
    Image.new("RGB", (8, 8)).save(good)
    image_folder(
        in_tmp / "imgs", {"cat/truncated.png": good.read_bytes()[:40], "dog/notes.png": b"not an image"}
    )
    err = fails(capsys, *imagefolder_args(in_tmp / "imgs"), "--run_dir", "r")
    assert "2 of 14 files under" in err and "not readable images" in err
    assert "cat/truncated.png" in err and "dog/notes.png" in err and "Delete or replace them" in err


@pytest.mark.claim("bad-input-one-paragraph", "bad-input-unreadable-images")
def test_at_most_ten_unreadable_files_are_listed_with_a_count_of_the_rest(in_tmp, capsys):
    bad = {f"{cls}/broken{i:02d}.png": b"not an image" for cls in ("cat", "dog") for i in range(6)}
    image_folder(in_tmp / "imgs", bad)
    err = fails(capsys, *imagefolder_args(in_tmp / "imgs"), "--run_dir", "r")
    assert "12 of 24 files under" in err  # 12 good images (6 per class) and the 12 broken ones
    assert sum(name in err for name in bad) == 10 and "and 2 more" in err


@pytest.mark.claim("bad-input-one-paragraph", "bad-input-labels")
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


@pytest.mark.claim("bad-input-one-paragraph", "bad-input-empty-split")
@pytest.mark.parametrize(
    "split, args, expected",
    [
        # Only a held-out share of 1 can empty the train split (stratifying refuses anything close to it).
        (
            "train",
            ["--data.init_args.val_fraction", "1"],
            ["train split empty", "--data.init_args.val_fraction"],
        ),
        # No val or test data to carve from: the split is named with the setting that would carve it.
        ("val", ["--data.init_args.val_fraction", "0"], ["There is no val split", "val_fraction is 0"]),
        ("test", ["--data.init_args.test_fraction", "0"], ["There is no test split", "test_fraction is 0"]),
    ],
)
def test_empty_split(in_tmp, capsys, split, args, expected):
    err = fails(capsys, *args, "--run_dir", "r")
    for text in expected:
        assert text in err
    assert f"--data.init_args.{'val' if split != 'test' else 'test'}_fraction" in err


@pytest.mark.claim("bad-input-one-paragraph", "bad-input-batch-size")
def test_batch_larger_than_training_split(in_tmp, capsys):
    err = fails(capsys, "--data.init_args.batch_size", "5000", "--run_dir", "r")
    assert "fewer than data.batch_size=5000" in err and "--data.init_args.batch_size" in err


@pytest.mark.claim("bad-input-batch-size")
def test_a_batch_larger_than_the_training_split_is_fine_for_evaluation():
    from project.data import ImageClassificationDataModule
    from project.errors import ConfigError

    ImageClassificationDataModule(batch_size=5000).setup("test")  # no training batch is drawn: no error
    with pytest.raises(ConfigError, match="fewer than data.batch_size=5000"):
        ImageClassificationDataModule(batch_size=5000).setup("fit")


# --- checkpoints --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ckpt") / "run"
    assert run_cli("fit", *TINY, WIDTH, "8", "--run_dir", run_dir) == 0
    return run_dir / "checkpoints/last.ckpt"


def test_template_checkpoints_load_with_weights_only(checkpoint):
    state = read_checkpoint(checkpoint)["state_dict"]
    assert state["model.head.1.weight"].shape == (10, 16)  # ConvNet(width=8): head Linear(16, 10)


@pytest.mark.claim("bad-input-one-paragraph", "bad-input-checkpoint")
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


@pytest.mark.claim("bad-input-one-paragraph", "bad-input-checkpoint")
def test_checkpoint_with_other_classes(checkpoint, in_tmp, capsys):
    ckpt = torch.load(checkpoint, weights_only=False)
    head = [k for k, v in ckpt["state_dict"].items() if v.ndim >= 1 and v.shape[0] == 10 and "acc" not in k]
    for k in head:  # as if trained on 5 classes
        ckpt["state_dict"][k] = ckpt["state_dict"][k][:5]
    torch.save(ckpt, in_tmp / "five.ckpt")
    err = fails(capsys, WIDTH, "8", "--ckpt_path", in_tmp / "five.ckpt", "--run_dir", "r")
    assert "different number of classes" in err and "checkpoint (5" in err and "model (10" in err


@pytest.mark.claim("bad-input-one-paragraph", "bad-input-checkpoint")
def test_truncated_checkpoint(checkpoint, in_tmp, capsys):
    data = checkpoint.read_bytes()
    (in_tmp / "cut.ckpt").write_bytes(data[: len(data) // 2])
    err = fails(capsys, WIDTH, "8", "--ckpt_path", in_tmp / "cut.ckpt", "--run_dir", "r")
    assert (
        f"Checkpoint '{in_tmp / 'cut.ckpt'}'" in err
        and "cannot be read" in err
        and "truncated, corrupt" in err
    )


@pytest.mark.claim("bad-input-one-paragraph", "bad-input-checkpoint")
def test_foreign_checkpoint(in_tmp, capsys):
    torch.save({"weights": torch.zeros(3)}, in_tmp / "other.pt")
    err = fails(capsys, "--ckpt_path", in_tmp / "other.pt", "--run_dir", "r")
    assert "not a Lightning checkpoint of this template" in err and "weights" in err


@pytest.mark.claim("bad-input-one-paragraph", "bad-input-checkpoint")
def test_missing_checkpoint_file(in_tmp, capsys):
    err = fails(capsys, "--ckpt_path", in_tmp / "nope.ckpt", "--run_dir", "r")
    assert f"Checkpoint '{in_tmp / 'nope.ckpt'}' does not exist" in err and "--ckpt_path" in err


# --- disk --------------------------------------------------------------------------------------------------


@pytest.mark.claim("bad-input-one-paragraph", "bad-input-run-dir")
def test_run_dir_not_writable(in_tmp, capsys):
    (in_tmp / "afile").write_text("")
    err = fails(capsys, "--run_dir", in_tmp / "afile/run")
    assert "is not writable" in err and "--run_dir" in err


class FillDisk(Callback):
    """Fills the disk once the first epoch's checkpoints are written, just before the second epoch's are."""

    fill = None  # set by the small_disk fixture

    def on_validation_end(self, trainer, pl_module) -> None:
        # Callbacks run before ModelCheckpoint, which Lightning moves to the end of the list.
        if trainer.current_epoch == 1 and not trainer.sanity_checking:
            FillDisk.fill()


@pytest.fixture
def small_disk(in_tmp, monkeypatch, request):
    """An 8 MB tmpfs to run on (root), and FillDisk.fill filling it up to `request.param` bytes.

    Without the right to mount (not root), the disk fills at the file-write level instead: from then on os.fsync,
    which the checkpoint writer calls before its rename, fails with ENOSPC, as it does on a full disk whose
    blocks were allocated lazily.
    """
    left = request.param
    disk = in_tmp / "disk"
    disk.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)]
    mounted = os.geteuid() == 0 and subprocess.run(mount, capture_output=True).returncode == 0

    def fill() -> None:
        if mounted:
            st = os.statvfs(disk)
            with open(disk / "filler", "wb") as f:
                f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - left))
        else:
            real_fsync = os.fsync

            def full(fd):
                real_fsync(fd)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

            monkeypatch.setattr(os, "fsync", full)

    monkeypatch.setattr(FillDisk, "fill", staticmethod(fill))
    print(
        f"full disk: {f'an 8 MB tmpfs, {left} bytes left' if mounted else 'os.fsync fails (no right to mount)'}"
    )
    yield disk
    monkeypatch.undo()
    if mounted:
        subprocess.run(["umount", "-l", str(disk)], check=True)


# The default model's checkpoint is ~0.8 MB. 16 KB left: the write fails in its first records, where Python's file
# raises OSError. 512 KB left: the disk fills inside a weight tensor's record, inside torch's zip writer.
@pytest.mark.claim("bad-input-one-paragraph", "bad-input-disk-full")
@pytest.mark.parametrize(
    "small_disk", [16 * 1024, 512 * 1024], ids=["16KB-left", "512KB-left"], indirect=True
)
def test_full_disk_while_saving_keeps_the_previous_checkpoint(small_disk, capsys):
    run = small_disk / "run"
    err = fails(
        capsys,
        "--trainer.max_epochs",
        "2",
        "--trainer.callbacks+=tests.test_bad_input.FillDisk",
        "--run_dir",
        run,
        started=True,
    )
    assert f"Saving checkpoint '{run / 'checkpoints'}" in err and "No space left on device" in err
    assert "--run_dir" in err and "--ckpt_path last" in err
    # Every checkpoint on disk is the first epoch's, whole and readable; the failed write left no temporary file.
    # (Which file the second epoch saves first, best or last, depends on the checkpoint-selection rule.)
    ckpts = sorted((run / "checkpoints").iterdir())
    assert "last.ckpt" in [p.name for p in ckpts]
    for path in ckpts:
        assert path.suffix == ".ckpt" and not path.name.startswith("."), path.name
        saved = torch.load(path, weights_only=True)
        assert saved["epoch"] == 0 and saved["global_step"] == 1


# --- memory ------------------------------------------------------------------------------------------------


class OOMModule(ClassificationModule):
    def training_step(self, batch, batch_idx):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


@pytest.mark.claim("bad-input-one-paragraph", "bad-input-oom")
def test_out_of_memory_names_the_batch_size_flag(in_tmp, capsys):
    err = fails(
        capsys, "--model.class_path", "tests.test_bad_input.OOMModule", "--run_dir", "r", started=True
    )
    assert (
        "out of GPU memory" in err
        and "--data.init_args.batch_size" in err
        and "Tried to allocate 2.00 GiB" in err
    )
    assert not (in_tmp / "r/checkpoints").exists()  # it stopped at its first step: nothing was saved


@pytest.mark.claim("bad-input-one-paragraph", "optimizer-scheduler-config")
@pytest.mark.parametrize(
    "args",
    [
        ["--optimizer", "torch.optim.SGD"],
        ["--lr_scheduler.class_path", "torch.optim.lr_scheduler.StepLR"],
        ["--optimizer=torch.optim.SGD", "--optimizer.lr", "0.1"],
    ],
    ids=["optimizer", "lr_scheduler", "optimizer-init-arg"],
)
def test_top_level_optimizer_flags_are_refused_naming_the_modules_keys(in_tmp, capsys, args):
    """LightningCLI's top-level --optimizer/--lr_scheduler would replace the module's configure_optimizers (its
    parameter groups and schedule) and run with exit 0: refused, naming the module's keys."""
    err = fails(capsys, *args, "--run_dir", "r")
    assert "Lightning's top-level flag" in err and "--model.init_args.optimizer" in err

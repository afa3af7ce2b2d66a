"""`python -m project doctor`: a report on this machine; exit status 1 only for problems that stop training."""

import pytest
import torch
import yaml

from tests.conftest import CONFIGS, run_cli
from tests.trained_run import trained_run


def test_doctor_on_this_machine(in_tmp, capsys):
    assert run_cli("doctor") == 0  # no CUDA here is not a failure
    out = capsys.readouterr().out
    for needle in (
        f"torch         {torch.__version__}",
        "lightning",
        "torchmetrics",
        "CUDA build",
        f"cuda.is_available  {torch.cuda.is_available()}",
        "NCCL",
        "gloo",
        "data loader workers per process: 0",
        "(writable)",
        "ok: data (digits) is present.",
        "doctor: ready for `make train`.",
    ):
        assert needle in out, needle
    assert "problem:" not in out


def test_doctor_missing_data_dir(in_tmp, capsys):
    code = run_cli(
        "doctor", "--data.init_args.source", "imagefolder", "--data.init_args.root", in_tmp / "missing"
    )
    assert code == 1
    problem = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("problem:")]
    assert (
        len(problem) == 1
        and "missing" in problem[0]
        and "--data.init_args.root" in problem[0]
        and "fix:" in problem[0]
    )


def test_doctor_gpu_accelerator_without_cuda(in_tmp, capsys):
    if torch.cuda.is_available():
        return
    assert run_cli("doctor", "--trainer.accelerator", "gpu") == 1
    assert "fix: --trainer.accelerator auto" in capsys.readouterr().out


def test_doctor_unwritable_run_dir_is_a_problem(in_tmp, capsys):
    (in_tmp / "afile").write_text("")  # a file where the run dir's parent folder would be
    assert run_cli("doctor", "--run_dir", in_tmp / "afile/run") == 1
    out = capsys.readouterr().out
    problem = [ln for ln in out.splitlines() if ln.startswith("problem:")]
    assert "(NOT writable)" in out and len(problem) == 1 and "cannot write" in problem[0]
    assert "--run_dir" in problem[0] and sorted(p.name for p in in_tmp.iterdir()) == ["afile"]


@pytest.mark.claim("doctor-reads-config-as-train")
def test_doctor_reads_an_overlay_as_training_does(in_tmp, tmp_path_factory, capsys):
    # configs/logger/wandb.yaml appends with `logger+`: training runs TensorBoard, CSV and W&B. The session's W&B
    # run (tests/trained_run.py: these two overlays, trained in-process) wrote the loggers it ran in config.yaml.
    run = trained_run(tmp_path_factory)
    trained = yaml.safe_load((run / "config.yaml").read_text())["trainer"]["logger"]
    ran = [logger["class_path"].rsplit(".", 1)[-1] for logger in trained]
    assert ran == ["TensorBoardLogger", "CSVLogger", "WandbLogger"]  # appended, not replaced
    capsys.readouterr()
    overlays = ("--config", CONFIGS / "debug/limit_batches.yaml", "--config", CONFIGS / "logger/wandb.yaml")
    assert run_cli("doctor", *overlays) == 0
    out = capsys.readouterr().out
    assert f"loggers       {', '.join(ran)}\n" in out


@pytest.mark.claim("any-dataset-degrades")
def test_doctor_on_another_data_module_imports_the_classes_it_names(in_tmp, capsys):
    assert run_cli("doctor", "--config", CONFIGS / "sequence.yaml") == 0
    out = capsys.readouterr().out
    assert (
        "data          project.data.DatasetDataModule (train project.data.sequences.DigitPixelSequences"
        in out
    )
    assert "ok: data module project.data.DatasetDataModule and the classes it names import." in out
    # A class path that does not import: the config parser, as `make train`'s, refuses it
    bad = ("--data.init_args.train.class_path", "no_such_module.Sequences")
    assert run_cli("doctor", "--config", CONFIGS / "sequence.yaml", *bad) == 1
    assert "problem: `make train` would refuse these arguments" in capsys.readouterr().out

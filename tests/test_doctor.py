"""`python -m project doctor`: a report on this machine; exit status 1 only for problems that stop training."""

import torch

from tests.conftest import run_cli


def test_doctor_on_this_machine(in_tmp, capsys):
    assert run_cli("doctor") == 0  # no CUDA here is not a failure
    out = capsys.readouterr().out
    for needle in (
        f"torch         {torch.__version__}",
        "lightning",
        "torchmetrics",
        "CUDA build",
        "CUDA driver",
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

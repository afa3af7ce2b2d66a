"""Run-directory and logger plumbing for resuming: SLURM requeue, wandb run id, CSV history (no training)."""

import pytest

import project.run_dir
from project.run_dir import keep_csv_history, resolve_run_dir


def test_requeued_slurm_job_continues_its_own_run_dir(in_tmp, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    first = resolve_run_dir(None, None)
    assert first.name.endswith("-slurm4242")
    first.mkdir(parents=True)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert resolve_run_dir(None, None) == first


def test_resumed_run_reuses_the_wandb_run_id(tmp_path):
    from project.loggers import wandb_run_id

    first = wandb_run_id(tmp_path)
    assert wandb_run_id(tmp_path) == first  # the same run dir (a resume) gets the same W&B run


@pytest.mark.claim("resume-continues-own-run", "csv-history-kept")
def test_resume_keeps_previous_csv_metrics(tmp_path):
    (tmp_path / "metrics.csv").write_text("epoch\n0\n")
    keep_csv_history(tmp_path)
    assert (tmp_path / "metrics.1.csv").read_text() == "epoch\n0\n" and not (
        tmp_path / "metrics.csv"
    ).exists()


@pytest.mark.claim("resume-continues-own-run")
def test_only_rank_0_moves_the_csv_history(tmp_path, monkeypatch):
    (tmp_path / "metrics.csv").write_text("epoch\n0\n")
    # as a torchrun/srun rank 1 parsing the same command
    monkeypatch.setattr(project.run_dir, "env_rank", lambda: 1)
    keep_csv_history(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.csv"]

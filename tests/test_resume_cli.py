"""Run-directory and logger plumbing for resuming: SLURM requeue, wandb run id, CSV history (no training)."""

import pytest

import project.distributed
from project.run_dir import keep_csv_history, resolve_run_dir


@pytest.mark.claim("ddp-slurm-requeue")
def test_requeued_slurm_job_continues_its_own_run_dir(in_tmp, monkeypatch):
    for var in ("SLURM_RESTART_COUNT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    first = resolve_run_dir(None, None)
    assert str(first) == "runs/slurm-4242"  # the name scripts/slurm.sbatch's tasks use
    first.mkdir(parents=True)
    second = resolve_run_dir(None, None)  # a second run in the same job gets its own directory
    assert str(second) == "runs/slurm-4242-1"
    second.mkdir()
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # requeued: the job reruns and continues its last run
    assert resolve_run_dir(None, None) == second


def test_resumed_run_reuses_the_wandb_run_id(tmp_path):
    from project.loggers import wandb_run_id

    first = wandb_run_id(tmp_path)
    assert not list(tmp_path.iterdir())  # nothing written before the run starts
    assert wandb_run_id(tmp_path) != first  # no W&B run in this directory yet: a new id each time
    # The folders W&B writes (online and offline); the newest one's id is the run to continue.
    (tmp_path / f"wandb/offline-run-20261201_101500-{first}").mkdir(parents=True)
    (tmp_path / "wandb/run-20261130_235900-older123").mkdir()
    (tmp_path / "wandb/latest-run").symlink_to(tmp_path / f"wandb/offline-run-20261201_101500-{first}")
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
    monkeypatch.setattr(project.distributed, "env_rank", lambda: 1)
    keep_csv_history(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.csv"]

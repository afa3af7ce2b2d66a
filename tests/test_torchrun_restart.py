"""scripts/torchrun.sh restarts a group whose rank died: a rank SIGKILLed at a forced moment (tests/ddp_probe.py's
KillAt: mid-step, during validation, while rank 0 writes a checkpoint), and the job still exits 0 with no human
step: one node of 2 processes killed at each moment in turn. Each restart continues the run from its last
checkpoint, and the run ends bit-identical to an undisturbed one: the one-process replay of the undisturbed
run's batches (tests/ddp_replay.py), the shards recomputed from the seed. CPU processes with gloo. Two agents (`--nnodes 2`,
c10d) restarting together: tests/test_ddp.py's two torchrun nodes, whose rank 0 dies writing a checkpoint."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from project.data.loaders import EpochShard
from tests.conftest import QUIET, REPO
from tests.ddp_probe import killing
from tests.ddp_processes import LAUNCH_DEADLINE_S, env_for_children, finish_together, free_port, start
from tests.ddp_replay import ranks, replay_run, weight_difference

TORCHRUN = REPO / "scripts/torchrun.sh"
BATCH, BATCHES = 32, 4  # per rank, and per epoch
FLAGS = (
    f"--trainer.max_epochs 2 --trainer.limit_train_batches {BATCHES} --trainer.limit_val_batches 2".split()
)
FLAGS += ["--test_after_fit", "false", *QUIET, "--data.init_args.batch_size", str(BATCH)]
# What the replay needs: each rank's EpochShard (tensors on the host, which Lightning keeps unwrapped), a model
# without BatchNorm or dropout, and the probe recording each rank's indices and rank 0's starting weights.
FLAGS += ["--data.init_args.in_memory", "false", "--model.init_args.model", "tests.ddp_probe.PlainCNN"]
FLAGS += ["--trainer.callbacks+=tests.ddp_probe.SampleProbe"]
PHASES = ["step", "validation", "checkpoint"]


def torchrun(*args, env: dict) -> subprocess.Popen:
    return start([TORCHRUN, *args], REPO, env)


def report(results) -> str:
    return "\n\n".join(f"agent {i}, exit {code}:\n{err[-5000:]}" for i, (code, _, err) in enumerate(results))


@pytest.fixture(scope="module")
def env() -> dict:
    return env_for_children() | {"PY": sys.executable, "OMP_NUM_THREADS": "1"}


@pytest.mark.claim("ddp-torchrun-restarts")
def test_default_is_three_restarts_with_a_c10d_rendezvous(tmp_path):
    echo = tmp_path / "python"
    echo.write_text('#!/usr/bin/env bash\necho "$*"\n')
    echo.chmod(0o755)
    args = [TORCHRUN, "--nnodes", "2", "--node_rank", "1", "--master_addr", "10.0.0.1", "--run_id", "x"]
    out = subprocess.run(
        args, env={**os.environ, "PY": str(echo)}, capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr
    assert "--max_restarts 3 --rdzv_backend c10d --rdzv_endpoint 10.0.0.1:29500 --rdzv_id x" in out.stdout
    assert "--rdzv_conf is_host=0" in out.stdout  # node 0 hosts the rendezvous store


@pytest.fixture(scope="module")
def killed(tmp_path_factory, env) -> tuple[Path, list]:
    """One job whose ranks are killed at each of PHASES in turn (3 restarts)."""
    tmp = tmp_path_factory.mktemp("restart")
    proc = torchrun("--nproc_per_node", "2", "--max_restarts", "3", "--master_port", free_port(), "--run_id",
                    "killed", "--", "--run_dir", tmp / "killed", *FLAGS, "--trainer.callbacks.out_dir", tmp / "probe",
                    *killing(tmp / "marker", PHASES), env=env)  # fmt: skip
    return tmp, finish_together([proc], timeout=2 * LAUNCH_DEADLINE_S - 30)


@pytest.mark.claim("ddp-torchrun-restarts")
@pytest.mark.slow
@pytest.mark.timeout(2 * LAUNCH_DEADLINE_S)
def test_a_rank_killed_mid_step_in_validation_and_mid_checkpoint_restarts_the_group(killed):
    tmp, results = killed
    assert [code for code, _, _ in results] == [0], report(results)
    assert (tmp / "marker").read_text().split() == PHASES  # each kill hit its phase, one per attempt
    starts = sorted((tmp / "marker.starts").read_text().splitlines())
    assert starts == ["start 0"] * 4 + ["start 1"] * 4, starts  # both ranks: the first start and 3 restarts


@pytest.mark.claim("ddp-torchrun-restarts")
@pytest.mark.slow
@pytest.mark.timeout(2 * LAUNCH_DEADLINE_S)
def test_restarted_run_continues_and_ends_bit_identical_to_an_undisturbed_one(killed):
    tmp, results = killed
    assert [code for code, _, _ in results] == [0], report(results)
    # Each restart continued the run from its last checkpoint (the starting command's rule), none started over.
    run_dir = tmp / "killed"
    resumes = (run_dir / "resumes.jsonl").read_text().splitlines()
    assert len(resumes) == len(PHASES), resumes
    # Every epoch's shards are the undisturbed run's: rank r's slice of the (seed, epoch) permutation, recomputed
    # from the seed, though a restarted rank trained its epoch again.
    r0, r1 = ranks(tmp / "probe")
    seed = yaml.safe_load((run_dir / "config.yaml").read_text())["seed_everything"]
    used = [[e["indices"][: BATCH * BATCHES] for e in r["train_epochs"]] for r in (r0, r1)]
    for r, record in enumerate((r0, r1)):
        assert [e["epoch"] for e in record["train_epochs"]] == [0, 1]
        for e, epoch in enumerate(record["train_epochs"]):
            shard = EpochShard(epoch["dataset"], seed, r, 2)
            shard.set_epoch(e)
            assert used[r][e] == list(shard)[: BATCH * BATCHES], (r, e)
    # The undisturbed run's computation in one process, from the first attempt's starting weights: bit for bit.
    final = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)[
        "state_dict"
    ]
    single, steps = replay_run(run_dir, torch.load(tmp / "probe" / "init.pt"), used, BATCH)
    differ, diff = weight_difference(single, final)
    assert steps == 2 * BATCHES and not differ, f"differ from the replay in {differ} (max {diff:.2e})"
    # One logger run: every attempt's TensorBoard events in the run directory, where an undisturbed run writes.
    folders = {p.parent for p in run_dir.glob("**/events.out.tfevents.*")}
    assert folders == {run_dir}, folders

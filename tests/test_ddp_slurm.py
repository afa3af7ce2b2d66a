"""scripts/slurm.sbatch under stand-in `sbatch`, `srun` and `scontrol` (this machine has no SLURM).

The stand-ins do what SLURM does for one node, and no more: sbatch runs the batch script with the job's SLURM_*
variables from the submit directory, and runs it again with SLURM_RESTART_COUNT=1 when the job was requeued;
srun starts SLURM_NTASKS copies of its command with SLURM_PROCID / SLURM_LOCALID set and waits for them;
`scontrol requeue <job>` marks the job for a rerun and ends it with SIGKILL (SLURM kills a requeued job; SIGKILL,
the harshest end, leaves no chance for a clean shutdown to hide a missing checkpoint).
Lightning itself is real: SLURMEnvironment, its SIGUSR1 handler (hpc checkpoint + `scontrol requeue`), its
hpc-checkpoint resume. The SIGUSR1 is real too, sent by each task to itself at one training step (SampleProbe),
as SLURM's `--signal=SIGUSR1@90` signals every task of the job at once.
"""

import json
import random
import socket
import sys

import pytest

from tests.conftest import CONFIGS, QUIET, REPO
from tests.ddp_processes import TEST_DEADLINE_S, env_for_children, finish, start

pytestmark = pytest.mark.ddp

SBATCH = """#!/usr/bin/env bash
# stand-in sbatch [--nodes=N] [--ntasks-per-node=M] script [args]: runs the job here, in the foreground
nodes=1 per_node=1
while [[ $1 == --* ]]; do
  case $1 in --nodes=*) nodes=${1#*=} ;; --ntasks-per-node=*) per_node=${1#*=} ;; esac
  shift
done
script=$1; shift
export SLURM_JOB_ID=$FAKE_SLURM_JOB_ID SLURM_JOB_NAME=project-ddp SLURM_SUBMIT_DIR=$PWD SLURM_NODELIST=127.0.0.1
export SLURM_JOB_NUM_NODES=$nodes SLURM_NNODES=$nodes SLURM_NTASKS_PER_NODE=$per_node
export SLURM_NTASKS=$((nodes * per_node))
restarts=0
while :; do
  ( [[ $restarts -gt 0 ]] && export SLURM_RESTART_COUNT=$restarts; exec bash "$script" "$@" ) \\
    > "$FAKE_SLURM/job-$restarts.out" 2> "$FAKE_SLURM/job-$restarts.err"
  code=$?
  echo "run $restarts exit $code" >> "$FAKE_SLURM/log"
  [[ -e $FAKE_SLURM/requeued-$restarts ]] || exit $code
  restarts=$((restarts + 1))
done
"""

SRUN = """#!/usr/bin/env bash
# stand-in srun: SLURM_NTASKS tasks of the command on this one node
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do
  SLURM_PROCID=$i SLURM_LOCALID=$i SLURM_NODEID=0 "$@" &
  pids+=($!)
done
echo "${pids[*]}" > "$FAKE_SLURM/tasks"
code=0
for pid in "${pids[@]}"; do wait "$pid" || code=$?; done
exit $code
"""

SCONTROL = """#!/usr/bin/env bash
# stand-in scontrol: `requeue <job>` marks the job for a rerun and ends it, as SLURM does
echo "scontrol $*" >> "$FAKE_SLURM/log"
if [[ $1 == requeue && $2 == "$SLURM_JOB_ID" ]]; then
  touch "$FAKE_SLURM/requeued-${SLURM_RESTART_COUNT:-0}"
  kill -KILL $(cat "$FAKE_SLURM/tasks")
fi
"""


def job_id_with_free_port() -> str:
    """A job id whose port (Lightning's SLURMEnvironment: 15000 + its last 4 digits) is free here."""
    for _ in range(100):
        job = str(random.randint(1000, 9999))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", 15000 + int(job)))
            except OSError:
                continue
        return job
    raise RuntimeError("no free port in 15000-24999")


@pytest.mark.claim("ddp-slurm-requeue", "ddp-one-run-dir")
@pytest.mark.timeout(TEST_DEADLINE_S)
def test_slurm_job_saves_on_sigusr1_requeues_and_resumes_in_the_same_run_dir(tmp_path):
    fake = tmp_path / "slurm"
    bin_dir = fake / "bin"
    bin_dir.mkdir(parents=True)
    for name, text in (("sbatch", SBATCH), ("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    submit = tmp_path / "submit"  # the job runs from its submit directory: a checkout's configs/ are there
    submit.mkdir()
    (submit / "configs").symlink_to(CONFIGS)
    job = job_id_with_free_port()
    env = env_for_children() | {
        "PATH": f"{bin_dir}:{env_for_children()['PATH']}",
        "FAKE_SLURM": str(fake),
        "FAKE_SLURM_JOB_ID": job,
        "PY": sys.executable,
        "OMP_NUM_THREADS": "1",  # 2 tasks on this machine's cores; the thread split is tested in test_ddp.py
    }
    for var in [v for v in env if v.startswith(("SLURM_", "MASTER_", "TORCHELASTIC_"))]:
        env.pop(var, None)
    epochs, usr1_step = 1, 7  # SIGUSR1 mid-epoch 0 (20 steps an epoch): the rerun must resume mid-epoch
    cmd = [
        bin_dir / "sbatch",
        "--nodes=1",
        "--ntasks-per-node=2",
        REPO / "scripts/slurm.sbatch",
        *QUIET,
        "--trainer.max_epochs",
        epochs,
        "--data.init_args.batch_size",
        "32",
        "--test_after_fit",
        "false",
        "--trainer.callbacks+=tests.ddp_probe.SampleProbe",
        "--trainer.callbacks.out_dir",
        tmp_path / "probe",
        "--trainer.callbacks.usr1_step",
        usr1_step,
    ]
    code, _, _ = finish(start(cmd, submit, env))  # both runs of the job
    log = (fake / "log").read_text() if (fake / "log").exists() else ""
    outputs = "\n".join(
        f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(fake.glob("job-*")) if p.is_file()
    )
    # The first run was requeued by Lightning (rank 0 ran `scontrol requeue <job id>`) and killed; the rerun ended.
    assert log.splitlines() == [f"scontrol requeue {job}", "run 0 exit 137", "run 1 exit 0"], log + outputs
    assert code == 0
    first, rerun = (fake / "job-0.out").read_text(), (fake / "job-1.out").read_text()
    assert "world size 2 = 2 per node x 1 node" in first  # two srun tasks formed one DDP world

    # One run directory for both tasks and both runs: runs/slurm-<job id> in the submit directory.
    runs = sorted(p.name for p in (submit / "runs").iterdir())
    assert runs == [f"slurm-{job}"], runs
    run = submit / "runs" / runs[0]
    assert (run / "hpc_ckpt_1.ckpt").exists()  # written on SIGUSR1, before the requeue
    assert (
        f"Restoring states from the checkpoint path at runs/slurm-{job}/hpc_ckpt_1.ckpt"
        in rerun + (fake / "job-1.err").read_text()
    )
    # The rerun continued from the signal's step on both ranks, and finished the run.
    r0, r1 = (json.loads((tmp_path / "probe" / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["start_step"] == r1["start_step"] == usr1_step
    assert r0["run_dir"] == r1["run_dir"] == f"runs/slurm-{job}"  # each task named it from the job id
    summary = json.loads((run / "summary.json").read_text())
    assert summary["global_step"] == epochs * 20 and summary["epochs"] == epochs  # 20 steps per epoch

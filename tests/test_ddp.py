"""DDP on CPU (gloo), each run in its own process group with a timeout: correctness, launchers, failure.

Three launches in all, each asserting several facts, because every process spends seconds importing torch:
  1. `make train-ddp`'s command, 2 processes: one run directory, rank-0-only files, accuracy, sharding,
     per-epoch reshuffling, every val/test sample counted exactly once.
  2. two `scripts/torchrun.sh` "nodes" on this machine: they train together, and their final weights equal one
     process trained on the same global batches in the same order.
  3. one rank raises midway: every process exits non-zero, quickly, and none is left behind.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import CONFIGS, QUIET, REPO

pytestmark = pytest.mark.ddp

PROBE = "tests.ddp_probe.SampleProbe"
# The digits split with odd val (145) and test (361) sizes, so that 2 ranks cannot split them evenly and
# a padding sampler would count a sample twice.
ODD_SPLITS = ["--data.init_args.test_fraction", "0.2005", "--data.init_args.val_fraction", "0.1005"]


def env_for_children() -> dict:
    # The checkout's `project` and `tests`, whatever directory the processes run in.
    env = {k: v for k, v in os.environ.items() if k != "PROJECT_RUN_DIR"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def start(cmd: list[str], cwd: Path, env: dict | None = None) -> subprocess.Popen:
    # A new session, so that a test can signal the launcher's process group (see kill_tree for torchrun's workers).
    return subprocess.Popen(
        [str(c) for c in cmd],
        cwd=cwd,
        env=env or env_for_children(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def descendants(pid: int) -> list[int]:
    ps = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True, check=True)
    table = [int(n) for n in ps.stdout.split()]
    children: dict[int, list[int]] = {}
    for child, parent in zip(table[::2], table[1::2]):
        children.setdefault(parent, []).append(child)
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a launcher and everything below it. torchrun starts each worker in a session of its own, so killing
    the launcher's process group alone would leave the workers running (and holding the pipes open)."""
    for pid in [*descendants(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def finish_together(
    procs: list[subprocess.Popen], timeout: float, grace: float = 30
) -> list[tuple[int, str, str]]:
    """Wait for processes that depend on each other, such as the nodes of one run, and return (code, out, err) each.

    Once one of them has failed, the others get `grace` seconds more: a node whose peer died before the process
    group formed waits for it until the group's timeout (30 min). Any still running then are killed, and the test
    fails showing every process's output, so that the first failure is the one on screen.
    """
    outputs: list[tuple[str, str]] = [("", "")] * len(procs)

    def collect(i: int) -> None:
        outputs[i] = procs[i].communicate()

    readers = [threading.Thread(target=collect, args=(i,), daemon=True) for i in range(len(procs))]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + timeout
    while any(r.is_alive() for r in readers) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
            deadline = min(deadline, time.monotonic() + grace)
        time.sleep(0.2)
    stuck = [i for i, r in enumerate(readers) if r.is_alive()]
    for i in stuck:
        kill_tree(procs[i])
    for reader in readers:
        reader.join(timeout=30)
    results = [(p.returncode, *out) for p, out in zip(procs, outputs)]
    if stuck:
        report = "\n\n".join(
            f"process {i} ({'killed, still running' if i in stuck else f'exit {code}'}): {procs[i].args[:4]}...\n"
            f"{out[-1500:]}\n{err[-4000:]}"
            for i, (code, out, err) in enumerate(results)
        )
        pytest.fail(f"not finished {timeout} s after the start, or {grace} s after a failure:\n{report}")
    return results


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str, str]:
    return finish_together([proc], timeout)[0]


def group_is_gone(pgid: int, wait: float) -> bool:
    """True once no process of the group is left (waiting up to `wait` s for exiting ones to be reaped)."""
    deadline = time.time() + wait
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        if time.time() > deadline:
            return False
        time.sleep(0.2)


def group_processes(pgid: int) -> str:
    return subprocess.run(
        ["ps", "-o", "pid,stat,etime,args", "-g", str(pgid)], capture_output=True, text=True
    ).stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ranks(probe_dir: Path) -> list[dict]:
    return [json.loads((probe_dir / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.timeout(240)
def test_make_train_ddp_two_cpu_processes(tmp_path):
    # The command `make train-ddp NPROC=2` runs (see the Makefile), 10 of the 30 epochs, 32 x 2 = global batch 64.
    cmd = [
        sys.executable,
        "-m",
        "project",
        "fit",
        "--config",
        CONFIGS / "default.yaml",
        "--config",
        CONFIGS / "ddp.yaml",
        "--trainer.devices",
        "2",
        "--trainer.num_nodes",
        "1",
        *QUIET,
        "--trainer.max_epochs",
        "10",
        "--data.init_args.batch_size",
        "32",
        *ODD_SPLITS,
        f"--trainer.callbacks+={PROBE}",
        "--trainer.callbacks.out_dir",
        tmp_path / "probe",
    ]
    code, out, err = finish(start(cmd, tmp_path), timeout=200)
    assert code == 0, err[-4000:]

    # Rank 0 announces the world; the last line names the one run directory.
    assert "world size 2 = 2 per node x 1 node, CPU processes with gloo" in out
    assert "Per-device batch 32, effective global batch 64" in out
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1 and out.strip().splitlines()[-1] == f"Run directory: runs/{runs[0].name}"
    # Only rank 0 wrote: one summary, one checkpoints/ (best + last), one config, one set of logs.
    run = runs[0]
    files = sorted(p.relative_to(run).as_posix() for p in run.rglob("*") if p.is_file())
    best = json.loads((run / "summary.json").read_text())["best_checkpoint"]
    # TensorBoard: one file for fit, one for test.
    events = [f for f in files if f.startswith("events.out.tfevents")]
    assert (
        files
        == sorted(
            [
                "checkpoints/" + Path(best).name,
                "checkpoints/last.ckpt",
                "config.yaml",
                "hparams.yaml",
                "metrics.csv",
                "report.png",
                "summary.json",
                *events,
            ]
        )
        and len(events) == 2
    ), files
    assert not [p for p in tmp_path.iterdir() if p.name not in ("runs", "probe")]  # nothing written elsewhere
    assert "[rank 1]" not in err  # rank 1 stays quiet: no repeated warnings or info lines
    summary = json.loads((run / "summary.json").read_text())
    print(
        f"\n2-process DDP: test_acc={summary['test_acc']:.4f} best_val_acc={summary['best_val_acc']:.4f} "
        f"train_seconds={summary['train_seconds']}"
    )
    # 1291 training samples / 2 ranks = 645.5 -> 20 full batches of 32 per rank and epoch.
    assert summary["global_step"] == 10 * 20
    assert summary["test_acc"] >= 0.99

    # Sharding: per epoch, disjoint rank sets whose union is the training set up to drop_last; a new order each epoch.
    r0, r1 = ranks(tmp_path / "probe")
    assert r0["world_size"] == r1["world_size"] == 2
    assert r0["train_epochs"][0]["sampler"] == "EpochSampler"  # digits default to the in-memory loader
    for e in range(2):
        a, b = (r["train_epochs"][e] for r in (r0, r1))
        assert a["epoch"] == b["epoch"] == e
        assert len(a["indices"]) == len(b["indices"]) == 640 and not set(a["indices"]) & set(b["indices"])
        assert len(set(a["indices"]) | set(b["indices"])) == 1280  # of 1291; 11 fall to drop_last and padding
    assert r0["train_epochs"][0]["indices"] != r0["train_epochs"][1]["indices"]
    # Every val and test sample counted exactly once across the ranks, though 145 and 361 do not split evenly.
    for stage, size in (("val", 145), ("test", 361)):
        a, b = r0[stage][-1], r1[stage][-1]
        assert a["dataset"] == size and sorted(a["indices"] + b["indices"]) == list(range(size))
        assert a["counted"] + b["counted"] == size


class GlobalBatches:
    """Batch sampler for one process: batch k of epoch e = rank 0's batch k + rank 1's batch k, exactly as the
    probe recorded them in the DDP run (whatever sampler Lightning used there).

    Lightning calls `set_epoch` on `batch_sampler.sampler`, so `sampler` is this object itself.
    """

    def __init__(self, rank_epochs: list[list[list[int]]], batch_size: int) -> None:
        self.rank_epochs, self.batch_size, self.sampler = rank_epochs, batch_size, self
        self.epoch, self.seen = 0, []

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.seen.append([])

    def __len__(self) -> int:
        return len(self.rank_epochs[0][0]) // self.batch_size  # drop_last, as the data module's train loader

    def __iter__(self):
        shards = [epochs[self.epoch] for epochs in self.rank_epochs]
        for k in range(len(self)):
            batch = [i for shard in shards for i in shard[k * self.batch_size : (k + 1) * self.batch_size]]
            self.seen[-1].append(batch)
            yield batch


@pytest.mark.timeout(240)
def test_two_torchrun_nodes_train_together_and_match_one_process(tmp_path):
    epochs = 10  # 10 x 20 = 200 optimizer steps
    port, run_dir = free_port(), tmp_path / "runs" / "two-nodes"
    # Two "nodes" of one process each on one machine: one thread each, or they oversubscribe the cores
    # (the CLI splits the cores only between the processes of one node).
    env = env_for_children() | {"PY": sys.executable, "PROJECT_RUN_DIR": str(run_dir), "OMP_NUM_THREADS": "1"}
    flags = [
        "--",
        *QUIET,
        "--trainer.max_epochs",
        epochs,
        "--data.init_args.batch_size",
        "32",
        "--data.init_args.augment",
        "false",
        "--model.init_args.model",
        "tests.ddp_probe.PlainCNN",
        # an explicit init arg: without one, the saved hyperparameters lack the model's init_args and the
        # CLI's data -> model links fail (jsonargparse), when the model class is swapped on the command line
        "--model.init_args.model.init_args.width",
        "16",
        "--trainer.limit_val_batches",
        "0",
        "--test_after_fit",
        "false",
        f"--trainer.callbacks+={PROBE}",
        "--trainer.callbacks.out_dir",
        tmp_path / "probe",
    ]
    nodes = [
        start(
            [
                REPO / "scripts/torchrun.sh",
                "--nnodes",
                "2",
                "--nproc_per_node",
                "1",
                "--node_rank",
                rank,
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                port,
                "--run_id",
                "two-nodes",
                *flags,
            ],
            tmp_path,
            env,
        )
        for rank in (0, 1)
    ]
    results = finish_together(nodes, timeout=200)
    assert [code for code, _, _ in results] == [0, 0], "\n\n".join(
        f"node {rank}, exit {code}:\n{err[-4000:]}" for rank, (code, _, err) in enumerate(results)
    )
    assert "world size 2 = 1 per node x 2 nodes" in results[0][1]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["global_step"] == epochs * 20 and list((tmp_path / "runs").iterdir()) == [run_dir]

    # One process, batch 64 = the two ranks' batches of 32, same order, same starting weights (rank 0's at fit start).
    import lightning as L

    from project.data import ImageClassificationDataModule
    from project.module import ClassificationModule

    ddp_final = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)
    module = ClassificationModule.load_from_checkpoint(run_dir / "checkpoints" / "last.ckpt")
    module.load_state_dict(torch.load(tmp_path / "probe" / "init.pt"))
    data = ImageClassificationDataModule(batch_size=64, augment=False)
    data.setup("fit")
    r0, r1 = ranks(tmp_path / "probe")
    recorded = [[e["indices"] for e in r["train_epochs"]] for r in (r0, r1)]
    batches = GlobalBatches(recorded, batch_size=32)
    loader = torch.utils.data.DataLoader(data.train_set, batch_sampler=batches)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each DDP rank had; a tiny model only loses time to more threads
    try:
        trainer.fit(module, train_dataloaders=loader)
    finally:
        torch.set_num_threads(threads)

    for e in range(epochs):  # the replay really saw the DDP ranks' batches
        assert [i for b in batches.seen[e] for i in b[:32]] == r0["train_epochs"][e]["indices"]
        assert [i for b in batches.seen[e] for i in b[32:]] == r1["train_epochs"][e]["indices"]
    single = module.state_dict()
    diff = max((single[k].float() - v.float()).abs().max().item() for k, v in ddp_final["state_dict"].items())
    print(f"\nDDP 2 x 32 vs 1 x 64 after {trainer.global_step} steps: max abs weight difference {diff:.2e}")
    assert trainer.global_step == summary["global_step"] == 200
    assert diff < 1e-4


@pytest.mark.timeout(120)
def test_a_failing_rank_stops_every_process(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "project",
        "fit",
        "--config",
        CONFIGS / "default.yaml",
        "--config",
        CONFIGS / "ddp.yaml",
        "--trainer.devices",
        "2",
        *QUIET,
        "--trainer.max_epochs",
        "3",
        "--data.init_args.batch_size",
        "32",
        f"--trainer.callbacks+={PROBE}",
        "--trainer.callbacks.out_dir",
        tmp_path / "probe",
        "--trainer.callbacks.crash_rank",
        "1",
        "--trainer.callbacks.crash_step",
        "5",
    ]
    proc = start(cmd, tmp_path)
    code, out, err = finish(proc, timeout=100)
    ended = time.time()
    crashed = float((tmp_path / "probe" / "crashed_at").read_text())
    print(f"\nrank 1 raised; all processes gone {ended - crashed:.1f} s later (exit code {code})")
    assert code != 0
    assert "fails on purpose" in err
    assert "[rank 1] uncaught RuntimeError" in err  # a non-zero rank's error says which rank it came from
    assert ended - crashed < 30  # gloo sees the peer gone; else Lightning's observer SIGKILLs all within 5 s
    left = "" if group_is_gone(proc.pid, wait=5) else group_processes(proc.pid)
    if left:
        os.killpg(proc.pid, signal.SIGKILL)
    assert not left, f"processes outlived the run:\n{left}\n{err[-3000:]}"
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").rglob("summary.json"))

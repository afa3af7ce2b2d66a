"""Kill -9 a training run at random moments, resume it each time from `last`, compare with an uninterrupted run.

    python scripts/kill_resume.py --kills 20            # the stronger check quoted in the README
    python scripts/kill_resume.py --kills 5 --seed 1    # what tests/test_resume_kill.py runs

The run is `python -m project fit` as a subprocess with a mid-epoch `last` checkpoint every optimizer step.
Each kill point is drawn at random: either a random time after the process starts (mid-epoch, validation,
test, startup: wherever it lands), or the moment a checkpoint's temporary file appears (a kill while a
checkpoint is being written). After the last kill the run is resumed to the end. Passes when the final
weights are bit-identical (torch.equal on every tensor) to an uninterrupted run and summary.json accuracies
match. Exit code 0 = pass.
"""

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
FLAGS = [
    "--trainer.enable_progress_bar",
    "false",
    "--trainer.enable_model_summary",
    "false",
    "--trainer.max_epochs",
    "3",
    "--trainer.limit_train_batches",
    "6",
    "--trainer.limit_val_batches",
    "2",
    "--trainer.limit_test_batches",
    "2",
    "--checkpoint_every_n_steps",
    "1",
    # Augmentation on (the digits default is off): its random stream is what a resume must restore exactly.
    "--data.init_args.augment",
    "true",
]


def command(run_dir: Path, resume: bool) -> list[str]:
    cmd = [sys.executable, "-m", "project", "fit", "--config", str(REPO / "configs/default.yaml"), *FLAGS]
    return cmd + ["--run_dir", str(run_dir)] + (["--ckpt_path", "last"] if resume else [])


def run_to_end(cmd: list[str], cwd: Path, timeout: float) -> None:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=_env())
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("PROJECT_RUN_DIR", None)
    return env


def kill_once(cmd: list[str], cwd: Path, run: Path, rng: random.Random, timeout: float) -> str:
    """Start the run, SIGKILL it at a random point; returns where (or 'finished' if it ended first).

    Kill points only count once this process trains: after its first checkpoint write (checkpoints are
    written every step), a kill lands after a random 0-2.5 s (mid-epoch, validation, test, ...), or during
    its k-th checkpoint write (k = 1..4: a kill while a checkpoint is being written).
    """
    mode = rng.choice(["time", "time", "write"])
    delay, nth_write = rng.uniform(0.0, 2.5), rng.randint(1, 4)
    start = time.time()
    log = open(cwd / "last_attempt.log", "w+")  # a file, not a pipe: a full pipe would block the child
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, env=_env())
    stale = set((run / "checkpoints").glob(".*.tmp"))  # left by an earlier kill: not a write in progress
    writes_seen: set = set()
    trained = None  # when this process wrote its first checkpoint
    try:
        while proc.poll() is None:
            now = time.time()
            if now - start > timeout:
                raise TimeoutError(f"run did not end within {timeout} s")
            tmp = set((run / "checkpoints").glob(".*.tmp")) - stale
            writes_seen |= tmp
            last = run / "checkpoints/last.ckpt"
            if trained is None and (writes_seen or (last.exists() and last.stat().st_mtime >= start)):
                trained = now
            writing = mode == "write" and tmp and len(writes_seen) >= nth_write
            if writing or (mode == "time" and trained is not None and now - trained >= delay):
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=30)
                return (
                    f"during checkpoint write #{len(writes_seen)}"
                    if writing
                    else f"{now - trained:.2f} s after its first checkpoint"
                )
            time.sleep(0.0005)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        log.close()
    if proc.returncode != 0:
        raise RuntimeError(f"run exited {proc.returncode}:\n{(cwd / 'last_attempt.log').read_text()[-3000:]}")
    return "finished"


def progress(run: Path) -> str:
    last = run / "checkpoints/last.ckpt"
    if not last.exists():
        return "scratch (no checkpoint yet)"
    ckpt = torch.load(last, map_location="cpu", weights_only=True)
    return f"step {ckpt['global_step']} (epoch {ckpt['epoch']})"


def compare(ref: Path, run: Path) -> list[str]:
    """Differences between two finished runs (empty = identical)."""
    a = torch.load(ref / "checkpoints/last.ckpt", map_location="cpu", weights_only=True)
    b = torch.load(run / "checkpoints/last.ckpt", map_location="cpu", weights_only=True)
    problems = [
        f"weights differ: {k}"
        for k in a["state_dict"]
        if not torch.equal(a["state_dict"][k], b["state_dict"][k])
    ]
    if a["global_step"] != b["global_step"]:
        problems.append(f"global_step {a['global_step']} vs {b['global_step']}")
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (ref, run))
    problems += [
        f"{k}: {sa.get(k)} vs {sb.get(k)}"
        for k in ("best_val_acc", "test_acc", "global_step")
        if sa.get(k) != sb.get(k)
    ]
    return problems


def kill_resume(
    workdir: Path, kills: int, seed: int = 0, timeout: float = 120.0, reference: Path | None = None
) -> dict:
    """Returns {"kills": [...where...], "problems": [...]}; reference: an already finished uninterrupted run."""
    workdir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    if reference is None:
        reference = workdir / "reference"
        run_to_end(command(reference, resume=False), workdir, timeout)
    run = workdir / "killed"
    where: list[str] = []
    problems: list[str] = []
    while len(where) < kills:
        outcome = kill_once(command(run, resume=True), workdir, run, rng, timeout)
        # ended before the kill point: check it, then place the next kills in a new run
        if outcome == "finished":
            problems += compare(reference, run)
            shutil.rmtree(run)
            continue
        where.append(f"{outcome}; resumes from {progress(run)}")
    run_to_end(command(run, resume=True), workdir, timeout)
    return {"kills": where, "problems": problems + compare(reference, run)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill points")
    parser.add_argument("--workdir", type=Path, default=Path("runs/kill_resume"))
    args = parser.parse_args()
    t0 = time.monotonic()
    # Absolute: the runs are started with cwd=workdir, so a relative --run_dir would nest inside it.
    result = kill_resume(args.workdir.resolve(), args.kills, args.seed)
    for i, where in enumerate(result["kills"], 1):
        print(f"kill {i:2d}: SIGKILL {where}")
    verdict = (
        "PASS: bit-identical to the uninterrupted run"
        if not result["problems"]
        else "FAIL: " + "; ".join(result["problems"])
    )
    print(f"{len(result['kills'])} kills, {time.monotonic() - t0:.0f} s. {verdict}")
    sys.exit(0 if not result["problems"] else 1)


if __name__ == "__main__":
    main()

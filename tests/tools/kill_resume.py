"""Kill -9 a training run at chosen points, resume it each time from `last`, compare with an uninterrupted run.

    python tests/tools/kill_resume.py --kills 20            # the stronger check quoted in the README
    python tests/tools/kill_resume.py --kills 3 --seed 1    # what tests/test_resume_kill.py runs

The run is `python -m project fit` as a subprocess with a mid-epoch `last` checkpoint every optimizer step.
The kills cycle through three kinds of moment, in an order and at steps drawn from --seed (so a seed always
gives the same schedule), and each kill is checked to have landed where it was aimed:

- train:      mid-epoch, in the middle of an optimizer step (after backward, before the update);
- validation: in the middle of an epoch-end validation;
- write:      while a checkpoint is being written: bytes are in its temporary file, not yet renamed.

The first two are reached through KillPoint, a callback added to the killed process only: at the chosen point
it writes where it is to a file and waits, without touching any state or random stream, and this script
kills it there. A write is caught from outside: once the aimed write's temporary file holds bytes, the
process is stopped (SIGSTOP), the file checked to be still there (not yet renamed), and the process killed. After the last kill the run
is resumed to the end. Passes when the final weights are bit-identical (torch.equal on every tensor) to an
uninterrupted run, summary.json accuracies match, and every kill landed where it was aimed. Exit code 0 = pass.
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
from lightning.pytorch.callbacks import Callback

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # tests/ddp_processes.py (Forked), and the callback named by class path
EPOCHS, STEPS_PER_EPOCH, VAL_BATCHES = 3, 6, 2
# As `make train` runs it (progress bar, model summary, every callback), only shorter.
FLAGS = [
    "--trainer.max_epochs",
    str(EPOCHS),
    "--trainer.limit_train_batches",
    str(STEPS_PER_EPOCH),
    "--trainer.limit_val_batches",
    str(VAL_BATCHES),
    "--trainer.limit_test_batches",
    "2",
    "--checkpoint_every_n_steps",
    "1",
    # Augmentation on (the digits default is off): its random stream is what a resume must restore exactly.
    "--data.init_args.augment",
    "affine",
]
MODES = ("train", "validation", "write")
MARKER = "kill_point.json"


class KillPoint(Callback):
    """Stops the process at one point and says where, so that a SIGKILL from outside lands exactly there.

    Args:
        mode: "train" (in the optimizer step that follows `step` completed steps, after backward) or
            "validation" (at validation batch `batch` of the epoch that ends after `step` steps).
        step: see mode.
        batch: validation batch index (mode "validation").
        marker: file written, then the process waits to be killed.
    It reads trainer counters and writes one file: no state, no random draws, nothing in the checkpoint.
    """

    def __init__(self, mode: str, step: int, marker: str, batch: int = 0) -> None:
        self.mode, self.step, self.marker, self.batch = mode, step, marker, batch

    def _wait_here(self, trainer, **where) -> None:
        where = {
            "mode": self.mode,
            "epoch": trainer.current_epoch,
            "global_step": trainer.global_step,
            **where,
        }
        tmp = Path(f"{self.marker}.{os.getpid()}.tmp")  # one per process: DDP ranks write the marker at once
        tmp.write_text(json.dumps(where))
        os.replace(tmp, self.marker)  # the reader sees the whole file or none
        while True:
            time.sleep(1)  # until kill_resume's SIGKILL

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._batch = batch_idx

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.mode == "train" and trainer.global_step == self.step:
            self._wait_here(trainer, batch=self._batch)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if (
            self.mode == "validation"
            and not trainer.sanity_checking
            and trainer.state.fn == "fit"
            and trainer.current_epoch == (self.step - 1) // STEPS_PER_EPOCH
            and batch_idx == self.batch
        ):
            self._wait_here(trainer, batch=batch_idx)


def command(run_dir: Path, resume: bool) -> list[str]:
    cmd = [sys.executable, "-m", "project", "fit", "--config", str(REPO / "configs/default.yaml"), *FLAGS]
    return cmd + ["--run_dir", str(run_dir)] + (["--ckpt_path", "last"] if resume else [])


def run_to_end(cmd: list[str], cwd: Path, timeout: float, fork: bool = False) -> None:
    if not fork:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=_env())
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
        return
    log = cwd / "last_attempt.log"
    proc = Forked(cmd, cwd, _env(), log)
    try:
        code = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if code != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {code}:\n{log.read_text()[-3000:]}")


class Forked:
    """`python -m project ...` (cmd) as a fork of this process instead of a new interpreter: the same run in a
    process of its own (a SIGKILL ends it and everything it held in memory, as for any process), without the
    seconds a new interpreter spends importing torch and lightning again (`make bench`:
    default_run.import_torch_lightning_seconds). What the kill tests need of a subprocess.Popen: pid, poll, wait,
    send_signal, kill, returncode. stdout and stderr go to `log`.

    For a caller that has imported torch already and runs one intra-op thread (OpenMP's pool does not survive a
    fork): tests/test_resume_kill.py. The command line script (main) starts new interpreters.
    """

    def __init__(self, cmd: list[str], cwd: Path, env: dict, log: Path) -> None:
        assert cmd[1:3] == ["-m", "project"], cmd
        from tests.ddp_processes import fork_main  # the fork the DDP tests start ranks with

        self.returncode: int | None = None
        self.pid = fork_main([str(a) for a in cmd[3:]], log, env=env, cwd=cwd)

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _env() -> dict:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    )
    return env


def aim(mode: str, done: int, rng: random.Random) -> dict | None:
    """Where the next kill goes, given the `done` optimizer steps of the checkpoint it resumes from; None when
    the rest of the run has no such point (the run is then finished and the kill placed in a new one)."""
    total = EPOCHS * STEPS_PER_EPOCH
    if mode == "train":  # 1-3 steps on, never an epoch's first batch (that would be an epoch-boundary resume)
        steps = [s for s in range(done + 1, total) if s % STEPS_PER_EPOCH]
        return {"mode": mode, "step": steps[min(rng.randint(0, 2), len(steps) - 1)]} if steps else None
    if mode == "validation":  # this epoch's validation, or the next one's
        ends = [e for e in range(STEPS_PER_EPOCH, total + 1, STEPS_PER_EPOCH) if e > done]
        if not ends:
            return None
        return {
            "mode": mode,
            "step": ends[min(rng.randint(0, 1), len(ends) - 1)],
            "batch": rng.randrange(VAL_BATCHES),
        }
    # the n-th checkpoint write of this process; fewer than the writes left (mid-epoch ones, one per epoch end)
    left = (
        sum(1 for s in range(done + 1, total + 1) if s % STEPS_PER_EPOCH) + (total - done) // STEPS_PER_EPOCH
    )
    return {"mode": mode, "nth_write": min(rng.randint(1, 4), left)} if left else None


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return True  # no /proc (not Linux): SIGSTOP has been sent; give it the moment below


def kill_once(cmd: list[str], cwd: Path, run: Path, target: dict, timeout: float, fork: bool = False) -> dict:
    """Start the run (fork: as a Forked copy of this process), SIGKILL it at `target` (see aim); returns where it
    landed ({"landed": "finished"} if the run ended first)."""
    marker = cwd / MARKER
    marker.unlink(missing_ok=True)
    if target["mode"] != "write":
        probe = {
            "class_path": "tests.tools.kill_resume.KillPoint",
            "init_args": {**target, "marker": str(marker)},
        }
        cmd = cmd + ["--trainer.callbacks+=" + json.dumps(probe)]
    start = time.time()
    log = open(cwd / "last_attempt.log", "w+")  # a file, not a pipe: a full pipe would block the child
    if fork:
        proc = Forked(cmd, cwd, _env(), cwd / "last_attempt.log")
    else:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, env=_env())
    stale = set((run / "checkpoints").glob(".*.tmp"))  # left by an earlier kill: not a write in progress
    writes_seen: set = set()
    armed: set = set()  # temporary files of the aimed write (and later ones, once it is missed)
    landed = None
    try:
        while proc.poll() is None and landed is None:
            if time.time() - start > timeout:
                raise TimeoutError(f"run did not end within {timeout} s")
            if target["mode"] == "write":
                new = set((run / "checkpoints").glob(".*.tmp")) - stale - writes_seen
                writes_seen |= new
                if new and len(writes_seen) >= target["nth_write"]:
                    armed |= new
                # the moment the aimed write has put bytes into its file (torch.save serialises first, then
                # writes, flushes, fsyncs and renames): a kill before the rename, with data on disk
                writing = [p for p in armed if _size(p) > 0]
                if writing:
                    os.kill(proc.pid, signal.SIGSTOP)  # freeze it, then look: is the write still going on?
                    deadline = time.time() + 5
                    while not _stopped(proc.pid) and time.time() < deadline:
                        time.sleep(0.0002)
                    if writing[0].exists():
                        landed = {"landed": "write", "file": writing[0].name, "bytes": _size(writing[0])}
                        proc.send_signal(signal.SIGKILL)
                    else:  # renamed before the stop took hold: aim at the next write
                        os.kill(proc.pid, signal.SIGCONT)
                armed = {p for p in armed if p.exists()}
            elif marker.exists():
                proc.send_signal(signal.SIGKILL)
                where = json.loads(marker.read_text())
                landed = {"landed": where.pop("mode"), **where}
            time.sleep(0.0005)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        log.close()
    if landed is not None:
        # a kill mid-write leaves the temporary file behind, never a torn last.ckpt
        if landed["landed"] == "write":
            landed["tmp_left"] = (run / "checkpoints" / landed["file"]).exists()
        return landed
    if proc.returncode != 0:
        raise RuntimeError(f"run exited {proc.returncode}:\n{(cwd / 'last_attempt.log').read_text()[-3000:]}")
    return {"landed": "finished"}


def progress(run: Path) -> dict:
    """The checkpoint a resume starts from: optimizer steps, epoch, batches of that epoch already trained."""
    last = run / "checkpoints/last.ckpt"
    if not last.exists():
        return {"global_step": 0, "epoch": 0, "position": 0}
    ckpt = torch.load(last, map_location="cpu", weights_only=True)
    (loader,) = ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    return {"global_step": ckpt["global_step"], "epoch": ckpt["epoch"], "position": loader["position"]}


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
    workdir: Path,
    kills: int,
    seed: int = 0,
    timeout: float = 120.0,
    reference: Path | None = None,
    fork: bool = False,
) -> dict:
    """Returns {"kills": [{"aimed": ..., "landed": ..., "resumes_from": ...}, ...], "problems": [...]};
    reference: an already finished uninterrupted run; fork: every run a Forked copy of this process."""
    workdir.mkdir(parents=True, exist_ok=True)
    # A run left here by an earlier invocation (of other code, perhaps) would be resumed and compared first.
    shutil.rmtree(workdir / "killed", ignore_errors=True)
    if reference is None:
        shutil.rmtree(workdir / "reference", ignore_errors=True)
    rng = random.Random(seed)
    modes: list[str] = []
    while len(modes) < kills:  # every kind in each round of three, in an order drawn from the seed
        modes += rng.sample(MODES, len(MODES))
    if reference is None:
        reference = workdir / "reference"
        run_to_end(command(reference, resume=False), workdir, timeout, fork)
    run = workdir / "killed"
    done: list[dict] = []
    problems: list[str] = []
    for mode in modes[:kills]:
        target = aim(mode, progress(run)["global_step"], rng)
        if target is None:  # no such point left in this run: finish it, check it, kill a new one
            run_to_end(command(run, resume=True), workdir, timeout, fork)
            problems += compare(reference, run)
            shutil.rmtree(run)
            target = aim(mode, 0, rng)
        landed = kill_once(command(run, resume=True), workdir, run, target, timeout, fork)
        done.append({"aimed": target, **landed, "resumes_from": progress(run)})
        if landed["landed"] != mode:
            problems.append(f"kill {len(done)} aimed at {target} landed: {landed}")
    run_to_end(command(run, resume=True), workdir, timeout, fork)
    return {"kills": done, "problems": problems + compare(reference, run)}


def describe(kill: dict) -> str:
    where = {
        "train": "mid-epoch, in the step after step {global_step} (epoch {epoch}, batch {batch})",
        "validation": "during validation of epoch {epoch} (batch {batch})",
        "write": "while writing a checkpoint ({file}, {bytes} bytes written, not yet renamed; left behind: {tmp_left})",
    }.get(kill["landed"], "{landed}: missed its point")
    r = kill["resumes_from"]
    return (
        where.format(**kill)
        + f"; resumes from step {r['global_step']} (epoch {r['epoch']}, batch {r['position']})"
    )


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
    for i, kill in enumerate(result["kills"], 1):
        print(f"kill {i:2d}: SIGKILL {describe(kill)}")
    verdict = (
        "PASS: bit-identical to the uninterrupted run"
        if not result["problems"]
        else "FAIL: " + "; ".join(result["problems"])
    )
    print(f"{len(result['kills'])} kills, {time.monotonic() - t0:.0f} s. {verdict}")
    sys.exit(0 if not result["problems"] else 1)


if __name__ == "__main__":
    main()

"""Kill -9 a streaming run (StreamingDataModule) at random moments, resume it each time from `last`, and compare
its final weights with an uninterrupted run's, bit for bit; one process or DDP on gloo.

    OMP_NUM_THREADS=1 python tests/tools/kill_resume_streaming.py --processes 1 --kills 8
    OMP_NUM_THREADS=1 python tests/tools/kill_resume_streaming.py --processes 2 --kills 8 --seed 1

The digits are prepared as `make prepare` writes them (default chunks), the run trains on them with one loader
worker per process, augmentation on, a `last` checkpoint after every optimizer step. The kills cycle through, at
points drawn from --seed:

- train:     mid-epoch, in the middle of an optimizer step (after backward, before the update);
- epoch_end: right after an epoch ended: its validation and checkpoints are written, the next epoch not begun
             (Lightning does not restore the loader's state from such a checkpoint);
- validation: in the middle of an epoch-end validation.

The run is first given `--trainer.max_epochs` 2 and resumed to that end (a finished run), then resumed
with max_epochs EPOCHS (the raise a user makes to train longer), with the remaining kills in those epochs. The
learning rate is constant (`--model.init_args.scheduler null`): the default schedule's length follows max_epochs,
so a raised run could not match one planned that long. Every process is a fork of this one (no new interpreter
importing torch per run); each rank of a DDP run is started as torchrun starts it (RANK, WORLD_SIZE, ...).
Exit code 0 = every final weight equal to the uninterrupted run's and every kill landed where it was aimed.
"""

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # the callback below is named by class path in the runs
from tests.ddp_processes import descendants, fork_main, torchrun_env  # noqa: E402 - forked ranks, as the tests
from tests.tools.kill_resume import KillPoint  # noqa: E402 - its marker file and wait, shared with the image-module kills

EPOCHS, BATCH, VAL_BATCHES = 6, 32, 2
TRAIN_SAMPLES = 1293  # the digits' training split as prepare writes it
MODES = ("train", "epoch_end", "validation")
MARKER = "kill_point.json"


class StreamKillPoint(KillPoint):
    """Writes where it is to `marker` at one point of the run, then waits to be killed there.

    Args:
        mode: "train" (in the optimizer step after `step` steps), "epoch_end" (as epoch `epoch` starts: the
            epoch before it ended and was checkpointed), "validation" (validation batch `batch` of epoch `epoch`).
        marker: the file written.
    It reads trainer counters and writes one file: no state, no random draws, nothing in the checkpoint.
    """

    def __init__(self, mode: str, marker: str, step: int = 0, epoch: int = 0, batch: int = 0) -> None:
        super().__init__(mode, step, marker, batch)  # kill_resume.KillPoint's marker file and wait
        self.epoch = epoch

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if self.mode == "epoch_end" and trainer.current_epoch == self.epoch:
            self._wait_here(trainer)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.mode == "train" and trainer.global_step == self.step:
            self._wait_here(trainer)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if (
            self.mode == "validation"
            and not trainer.sanity_checking
            and trainer.state.fn == "fit"
            and trainer.current_epoch == self.epoch
            and batch_idx == self.batch
        ):
            self._wait_here(trainer, batch=batch_idx)


def fit_args(data: Path, run: Path, world: int, epochs: int, resume: bool) -> list[str]:
    args = ["fit", "--config", str(REPO / "configs/default.yaml")]
    if world > 1:
        args += ["--config", str(REPO / "configs/ddp.yaml"), "--trainer.devices", str(world)]
        args += ["--trainer.num_nodes", "1"]
    args += ["--trainer.enable_progress_bar", "false", "--trainer.max_epochs", str(epochs)]
    args += ["--trainer.limit_val_batches", str(VAL_BATCHES), "--checkpoint_every_n_steps", "1"]
    args += ["--data", "project.data.StreamingDataModule", "--data.init_args.input_dir", str(data)]
    args += ["--data.init_args.batch_size", str(BATCH), "--data.init_args.num_workers", "1"]
    args += ["--data.init_args.augment", "affine", "--model.init_args.scheduler", "null"]
    args += ["--run_dir", str(run)]
    return args + (["--ckpt_path", "last"] if resume else [])


def run(
    args: list[str], world: int, workdir: Path, timeout: float, marker: Path | None = None
) -> dict | None:
    """Start the ranks; with `marker`, SIGKILL them (and their loader workers) once it is written and return
    what it says (None: the run ended first); without, wait for a clean exit."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = lambda r: {**os.environ, **torchrun_env(r, world, port)} if world > 1 else None  # noqa: E731
    pids = [fork_main(args, workdir / f"rank{r}.log", env=env(r)) for r in range(world)]
    codes: dict[int, int] = {}
    landed, deadline = None, time.monotonic() + timeout
    try:
        while len(codes) < world and landed is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the run did not end within {timeout} s: see {workdir}/rank*.log")
            for pid in pids:
                if pid not in codes:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        codes[pid] = os.waitstatus_to_exitcode(status)
            if any(codes.values()):
                raise RuntimeError(f"a rank exited {codes}:\n{(workdir / 'rank0.log').read_text()[-3000:]}")
            if marker is not None and marker.exists():
                landed = json.loads(marker.read_text())
            time.sleep(0.005)
    finally:
        for pid in pids:
            if pid not in codes:
                for p in [*descendants(pid), pid]:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p, signal.SIGKILL)
                os.waitpid(pid, 0)
    return landed


def progress(run_dir: Path) -> dict:
    """The checkpoint a resume starts from."""
    last = run_dir / "checkpoints/last.ckpt"
    if not last.exists():
        return {"global_step": 0, "epoch": 0, "loader": None}
    ckpt = torch.load(last, map_location="cpu", weights_only=True)
    (loader,) = ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    return {"global_step": ckpt["global_step"], "epoch": ckpt["epoch"], "loader": loader}


def aim(mode: str, done: int, epochs: int, steps: int, rng: random.Random) -> dict | None:
    """A kill point after the `done` steps of the checkpoint resumed from, within `epochs`; None if none is left."""
    total = epochs * steps
    if mode == "train":  # within the next epoch's worth of steps, never an epoch's first (epoch_end's point)
        left = [s for s in range(done + 1, total) if s % steps]
        return {"mode": mode, "step": rng.choice(left[:steps])} if left else None
    if mode == "epoch_end":  # the next epoch that this process starts itself (not the one it resumes into)
        first = done // steps + 1
        return {"mode": mode, "epoch": first} if first < epochs else None
    epoch = done // steps  # this epoch's validation, or the next one's when resumed after it
    return {"mode": mode, "epoch": epoch, "batch": rng.randrange(VAL_BATCHES)} if epoch < epochs else None


def max_difference(ref: Path, other: Path) -> float:
    a, b = (
        torch.load(d / "checkpoints/last.ckpt", map_location="cpu", weights_only=True) for d in (ref, other)
    )
    return max(
        (a["state_dict"][k].double() - b["state_dict"][k].double()).abs().max().item()
        for k in a["state_dict"]
        if a["state_dict"][k].numel()
    )


def kill_resume_streaming(
    workdir: Path, world: int, kills: int, seed: int = 0, timeout: float = 300.0
) -> dict:
    """{"kills": [...], "problems": [...], "max_difference": float}; every run in workdir."""
    import project.cli  # noqa: F401 - imported once here, not in every forked run
    import project.data.streaming  # noqa: F401
    from project.prepare import prepare
    from tests.tools import kill_resume  # compare()

    workdir.mkdir(parents=True, exist_ok=True)
    data = workdir / "digits-stream"
    prepare("digits", str(data))
    steps = TRAIN_SAMPLES // BATCH // world
    reference, killed = workdir / "reference", workdir / "killed"
    for d in (reference, killed):
        shutil.rmtree(d, ignore_errors=True)
    run(fit_args(data, reference, world, EPOCHS, False), world, workdir, timeout)

    rng = random.Random(seed)
    modes: list[str] = []
    while len(modes) < kills:
        modes += rng.sample(MODES, len(MODES))
    done: list[dict] = []
    problems: list[str] = []
    marker = workdir / MARKER
    epochs = 2  # the first max_epochs, raised to EPOCHS once the run has finished it
    raised = False
    for i, mode in enumerate(modes[:kills]):
        target = aim(mode, progress(killed)["global_step"], epochs, steps, rng)
        if not raised and (i >= kills // 2 or target is None):
            run(fit_args(data, killed, world, epochs, True), world, workdir, timeout)  # the run finishes
            done.append({"landed": "finished", "max_epochs": epochs, "resumes_from": progress(killed)})
            epochs, raised = EPOCHS, True
            target = aim(mode, progress(killed)["global_step"], epochs, steps, rng)
        if target is None:
            problems.append(f"no {mode} point left for kill {i + 1}: give the run more EPOCHS")
            continue
        marker.unlink(missing_ok=True)
        probe = {
            "class_path": "tests.tools.kill_resume_streaming.StreamKillPoint",
            "init_args": {**target, "marker": str(marker)},
        }
        args = fit_args(data, killed, world, epochs, resume=True) + [
            "--trainer.callbacks+=" + json.dumps(probe)
        ]
        landed = run(args, world, workdir, timeout, marker)
        done.append(
            {"aimed": target, "landed": landed, "max_epochs": epochs, "resumes_from": progress(killed)}
        )
        if landed is None or landed["mode"] != mode:
            problems.append(f"kill {i + 1} aimed at {target} landed: {landed}")
    run(fit_args(data, killed, world, EPOCHS, True), world, workdir, timeout)
    problems += kill_resume.compare(reference, killed)
    return {"kills": done, "problems": problems, "max_difference": max_difference(reference, killed)}


def describe(kill: dict) -> str:
    r = kill["resumes_from"]
    loader = r["loader"] or {}
    state = f"{loader.get('num_samples_yielded', 0)} samples read"
    after = f"; resumes from step {r['global_step']} (epoch {r['epoch']}, loader: litdata epoch "
    after += f"{loader.get('current_epoch')}, {state}, max_epochs {kill['max_epochs']})"
    if kill["landed"] == "finished":
        return f"run finished at max_epochs {kill['max_epochs']}, resumed with max_epochs {EPOCHS}" + after
    where = kill["landed"] or {"mode": "missed"}
    text = {
        "train": "mid-epoch, in the optimizer step after step {global_step} (epoch {epoch})",
        "epoch_end": "right after epoch {last} ended (checkpointed, epoch {epoch} not begun; step {global_step})",
        "validation": "during validation of epoch {epoch} (batch {batch}, step {global_step})",
    }.get(where["mode"], "missed its point: {mode}")
    return "SIGKILL " + text.format(last=where.get("epoch", 0) - 1, **where) + after


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--processes", type=int, default=1, help="1, or DDP ranks on gloo (CPU)")
    parser.add_argument("--kills", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill points")
    parser.add_argument("--workdir", type=Path, default=Path("runs/kill_resume_streaming"))
    args = parser.parse_args()
    if torch.get_num_threads() != 1:
        sys.exit(
            "Run with OMP_NUM_THREADS=1: every run is a fork of this process, and OpenMP's threads do not fork."
        )
    t0 = time.monotonic()
    result = kill_resume_streaming(args.workdir.resolve(), args.processes, args.kills, args.seed)
    for i, kill in enumerate(result["kills"], 1):
        print(f"{i:2d}: {describe(kill)}")
    verdict = "PASS: bit-identical" if not result["problems"] else "FAIL: " + "; ".join(result["problems"])
    n = sum(1 for k in result["kills"] if k["landed"] != "finished")
    print(
        f"{args.processes} process(es), {n} kills, {time.monotonic() - t0:.0f} s. Final weights' largest difference "
        f"from the uninterrupted run: {result['max_difference']:.3g}. {verdict}"
    )
    sys.exit(0 if not result["problems"] else 1)


if __name__ == "__main__":
    main()

"""StreamingDataModule under DDP (gloo, 2 processes): shards, evaluation counts, epoch end, kill -9 and resume.

One test, four 2-rank runs of `python -m project fit` (configs/default.yaml + configs/ddp.yaml, the data module
replaced by tests/streaming_probe.py's recording subclass of project.data.StreamingDataModule) on the digits
prepared by `python -m project prepare`:
  1. an uninterrupted 2-epoch run, the reference: per rank and epoch, the samples read (disjoint, reshuffled, the
     whole split but the documented remainder), every validation and test sample counted exactly once, both
     processes gone at the end (no hang at an epoch's end: litdata issue #129);
  2. the same run given max_epochs 1 (it finishes: a checkpoint at an epoch's end), then resumed with max_epochs 2
     and killed with SIGKILL (every rank) in the middle of an optimizer step of the second epoch;
  3. its resume from `last`: the rest of that epoch reads exactly the batches the reference read there, and the
     final weights and summary equal the reference's bit for bit (tests/tools/kill_resume.py's compare).

The ranks are started as torchrun starts them (RANK, WORLD_SIZE, MASTER_ADDR, ... in the environment). When this
process runs one intra-op thread (tests/conftest.py sets OMP_NUM_THREADS=1), each rank is a fork of it: a process
of its own that SIGKILL ends, without the seconds of imports (torch, lightning) a new interpreter spends
(OpenMP's thread pool does not survive a fork; with more threads, new interpreters are started instead).
"""

import importlib.util
import json
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.conftest import CONFIGS, QUIET, REPO, run_cli
from tests.ddp_processes import LAUNCH_DEADLINE_S, run_ranks
from tests.streaming_probe import sample_key

spec = importlib.util.spec_from_file_location("kill_resume", REPO / "tests/tools/kill_resume.py")
kill_resume = importlib.util.module_from_spec(spec)  # KillPoint (by class path in the run), MARKER, compare
spec.loader.exec_module(kill_resume)

pytestmark = pytest.mark.ddp

WORLD, BATCH, EPOCHS = 2, 32, 2
# The digits split as prepare writes it (prepare.json): train 1293, val 144, test 360.
SPLITS = {"train": 1293, "val": 144, "test": 360}
# litdata's drop_last under DDP: floor(1293 / 32) = 40 full batches, 40 // 2 = 20 per rank: 640 samples per rank
# and epoch; the other 1293 - 1280 = 13 are left out of that epoch (a different 13 each epoch).
STEPS_PER_EPOCH = SPLITS["train"] // BATCH // WORLD
PER_RANK = STEPS_PER_EPOCH * BATCH
# The kill: in the optimizer step after this many, mid-way through the second epoch (the checkpoint written
# after it holds a loader 6 batches into that epoch).
KILL_AFTER_STEP = STEPS_PER_EPOCH + 6


def stored_keys(split_dir: Path) -> Counter:
    """Every sample of a prepared split, read directly (one process, no sharding)."""
    from litdata import StreamingDataset

    return Counter(sample_key(item["image"], item["label"]) for item in StreamingDataset(str(split_dir)))


def records(record_dir: Path) -> list[dict]:
    return [json.loads((record_dir / f"rank{r}.json").read_text()) for r in range(WORLD)]


def flat(batches: list[list[str]]) -> list[str]:
    return [key for batch in batches for key in batch]


@pytest.mark.claim(
    "stream-ddp-disjoint-shards",
    "stream-reshuffled-per-epoch",
    "stream-eval-exactly-once",
    "stream-ddp-epoch-end",
    "stream-ddp-resume-exact",
    "stream-resume-epoch-end",
)
@pytest.mark.timeout(4 * LAUNCH_DEADLINE_S + 120)  # four runs, each with its own deadline, and the prepare
def test_two_ranks_shards_eval_epoch_end_and_kill_9_resume(tmp_path):
    data = tmp_path / "digits-stream"
    # as `make prepare` writes them: the default chunks (at least project.data.chunks.MIN_CHUNKS per split)
    assert run_cli("prepare", "--source", "digits", "--output_dir", data) == 0
    assert json.loads((data / "prepare.json").read_text())["splits"] == SPLITS
    stored = {split: stored_keys(data / split) for split in SPLITS}
    assert {split: sum(c.values()) for split, c in stored.items()} == SPLITS

    def fit(run: str, record: str, *extra: str) -> list[str]:
        return [
            "fit",
            "--config",
            str(CONFIGS / "default.yaml"),
            "--config",
            str(CONFIGS / "ddp.yaml"),
            "--trainer.devices",
            str(WORLD),
            "--trainer.num_nodes",
            "1",
            *QUIET,
            "--trainer.max_epochs",
            str(EPOCHS),
            "--data",
            "tests.streaming_probe.RecordingStreamingDataModule",
            "--data.init_args.input_dir",
            str(data),
            "--data.init_args.batch_size",
            str(BATCH),
            "--data.init_args.record_dir",
            str(tmp_path / record),
            "--trainer.callbacks+=tests.streaming_probe.EvalCounts",
            # constant: the run killed below first finishes 1 epoch, then is resumed with max_epochs 2, and the
            # default schedule's length follows max_epochs
            "--model.init_args.scheduler",
            "null",
            "--run_dir",
            str(tmp_path / run),
            *extra,
        ]

    # 1. The reference: both ranks exit 0 on their own, within the deadline (run_ranks fails the test on a hang).
    started = time.monotonic()
    codes = run_ranks(fit("reference", "rec-reference"), tmp_path, tmp_path / "logs-reference")
    assert codes == [0, 0], (tmp_path / "logs-reference" / "rank0.log").read_text()[-3000:]
    print(f"\nreference: 2 ranks x {EPOCHS} epochs in {time.monotonic() - started:.1f} s")
    ref = records(tmp_path / "rec-reference")
    assert [r["rank"] for r in ref] == [0, 1] and {r["world_size"] for r in ref} == {WORLD}

    # Training: per epoch, each rank reads PER_RANK samples in full batches, the ranks' samples are disjoint (as
    # multisets: two stored images may be equal), and together they are the split but the remainder.
    for epoch in map(str, range(EPOCHS)):
        reads = [Counter(flat(r["train"][epoch])) for r in ref]
        assert [len(r["train"][epoch]) for r in ref] == [STEPS_PER_EPOCH] * WORLD
        assert all(len(b) == BATCH for r in ref for b in r["train"][epoch])
        together = reads[0] + reads[1]
        assert together <= stored["train"], "a sample was read twice in one epoch"
        assert sum(together.values()) == WORLD * PER_RANK == SPLITS["train"] - 13
    # Reshuffled: each rank's order, and which samples it reads, change from epoch to epoch.
    for r in ref:
        assert r["train"]["0"] != r["train"]["1"]
        assert Counter(flat(r["train"]["0"])) != Counter(flat(r["train"]["1"]))
    # Validation (every epoch) and test: all samples, each once, across the ranks; the metrics counted as many.
    # The ranks' shares differ (litdata gives the remainder to the last rank): 144 = 64 + 80, 360 = 160 + 200.
    assert [list(r["val"]) for r in ref] == [[str(e) for e in range(EPOCHS)]] * WORLD
    assert [len(r["test"]) for r in ref] == [1] * WORLD  # one test after fit (at the trainer's last epoch)
    for stage in ("val", "test"):
        for i, epoch in enumerate(ref[0][stage]):
            reads = [Counter(flat(r[stage][epoch])) for r in ref]
            assert reads[0] + reads[1] == stored[stage], (stage, epoch)
            counted = [r["eval_counted"][stage][i] for r in ref]
            assert counted == [sum(c.values()) for c in reads] and sum(counted) == SPLITS[stage]
    # The run's summary: one fit of EPOCHS epochs of STEPS_PER_EPOCH steps.
    summary = json.loads((tmp_path / "reference" / "summary.json").read_text())
    assert summary["global_step"] == EPOCHS * STEPS_PER_EPOCH and summary["epochs"] == EPOCHS

    # 2. The same run, first given max_epochs 1: it finishes that epoch (a checkpoint at an epoch's end, from
    # which Lightning does not restore the loader's state: the loader takes its epoch from the trainer)...
    first = fit("killed", "rec-first", "--trainer.max_epochs", "1", "--test_after_fit", "false")
    codes = run_ranks(first, tmp_path, tmp_path / "logs-first")
    assert codes == [0, 0], (tmp_path / "logs-first" / "rank0.log").read_text()[-3000:]
    # ... then is resumed with max_epochs 2 and killed in the middle of an optimizer step (tests/tools/kill_resume.py's
    # KillPoint: each rank writes the marker there and waits), with a mid-epoch `last` written just before.
    marker = tmp_path / kill_resume.MARKER
    point = {"mode": "train", "step": KILL_AFTER_STEP, "marker": str(marker)}
    probe = json.dumps({"class_path": "tests.tools.kill_resume.KillPoint", "init_args": point})
    ckpt_at_kill = [
        "--checkpoint_every_n_steps",
        str(KILL_AFTER_STEP),
    ]  # `last` after the step before the kill
    resume = ["--ckpt_path", "last", f"--trainer.callbacks+={probe}"]
    killed_args = fit("killed", "rec-killed", *ckpt_at_kill, *resume)
    codes = run_ranks(killed_args, tmp_path, tmp_path / "logs-killed", until=marker.exists)
    assert marker.exists() and codes == [-signal.SIGKILL] * WORLD, codes
    landed = json.loads(marker.read_text())
    assert landed["global_step"] == KILL_AFTER_STEP and landed["epoch"] == 1, landed
    ckpt = torch.load(
        tmp_path / "killed" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True
    )
    (loader,) = ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"]  # StreamingDataLoader.state_dict()
    done = KILL_AFTER_STEP - STEPS_PER_EPOCH  # batches of the second epoch in the checkpoint
    assert ckpt["global_step"] == KILL_AFTER_STEP and loader["num_samples_yielded"] == done * BATCH, loader

    # 3. The resume, from `last`, to the end (and the test after fit).
    resumed_args = fit("killed", "rec-resumed", *ckpt_at_kill, "--ckpt_path", "last")
    codes = run_ranks(resumed_args, tmp_path, tmp_path / "logs-resumed")
    assert codes == [0, 0], (tmp_path / "logs-resumed" / "rank0.log").read_text()[-3000:]
    resumed = records(tmp_path / "rec-resumed")
    for r, reference in zip(resumed, ref, strict=True):
        # The rest of the interrupted epoch, exactly as the reference read it, batch by batch.
        assert list(r["train"]) == ["1"] and r["train"]["1"] == reference["train"]["1"][done:]
    # weights bit for bit, steps, best val acc, test acc
    problems = kill_resume.compare(tmp_path / "reference", tmp_path / "killed")
    assert problems == [], problems

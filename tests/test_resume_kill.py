"""Kill -9 a run mid-epoch, during validation and while a checkpoint is written, resume from `last` each time:
the end result is bit-identical to an uninterrupted run (tests/tools/kill_resume.py --kills 20 is the stronger
check). Kill -9 a checkpoint writer: the file on disk is always a whole checkpoint."""

import importlib.util
import os
import sys

import pytest
import torch

from project.checkpoint_io import AtomicCheckpointIO
from tests.conftest import CONFIGS, REPO, run_cli

pytestmark = pytest.mark.slow

spec = importlib.util.spec_from_file_location("kill_resume", REPO / "tests/tools/kill_resume.py")
kill_resume = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kill_resume)
STEPS = kill_resume.STEPS_PER_EPOCH


# Calls that change what is on disk (the last part of the callee's name): a process can only leave a different
# file behind if it dies between two of them.
IO_CALLS = {
    "open", "fdopen", "mkstemp", "write", "writelines", "write_record", "write_end_of_file", "flush", "fsync",
    "close", "__exit__", "truncate", "ftruncate", "replace", "rename", "link", "symlink", "unlink", "remove",
    "sendfile", "copyfile", "copyfileobj", "copy_file_range", "splice",
}  # fmt: skip


def _io_call_numbers(write) -> list[int]:
    """Run `write()` under a profiler; the event numbers at which it calls into I/O (see IO_CALLS)."""
    numbers, count = [], 0

    def hook(frame, event, arg):
        nonlocal count
        count += 1
        if event == "c_call" and getattr(arg, "__name__", "").rsplit(".", 1)[-1] in IO_CALLS:
            numbers.append(count)

    sys.setprofile(hook)
    try:
        write()
    finally:
        sys.setprofile(None)
    return numbers


@pytest.mark.claim("checkpoint-write-atomic")
def test_a_crash_before_any_io_call_of_a_write_leaves_a_whole_checkpoint(tmp_path):
    """What a crash can leave on disk changes only at I/O calls. For each I/O call a checkpoint write makes
    (opening, each record torch.save writes, flush, fsync, close, rename, cleanup), a forked child dies just
    before it (os._exit: no cleanup runs, as with kill -9); last.ckpt must then load and be the old or the new
    version whole, never a torn file."""
    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    # ~1 MB each, like the ConvNet's checkpoints; made here, so the child runs no parallel torch op
    blobs = [torch.zeros(250_000), torch.ones(250_000)]
    io.save_checkpoint({"version": 0, "blob": blobs[0]}, path)

    def write(version: int) -> None:  # the same call in the profiled run and in the children
        io.save_checkpoint({"version": version, "blob": blobs[version % 2]}, path)

    points = _io_call_numbers(lambda: write(1))
    assert len(points) >= 8, points  # open, >= 3 records, flush, fsync, close, rename: the write is seen
    seen = []
    for version, point in enumerate([*points, None], start=2):  # None: no crash, the write completes
        for stale in tmp_path.glob(".*.tmp"):  # the same directory state for every child
            stale.unlink()
        pid = os.fork()
        if pid == 0:
            count = 0

            def die(frame, event, arg, point=point):
                nonlocal count
                count += 1
                if count == point:  # the I/O call's c_call event: it has not run yet
                    os._exit(3)

            code = 1  # the child never returns into pytest, whatever happens
            try:
                sys.setprofile(die)
                (lambda: write(version))()
                sys.setprofile(None)
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        ckpt = torch.load(path, map_location="cpu", weights_only=True)  # a torn zip raises here
        assert torch.equal(ckpt["blob"], blobs[ckpt["version"] % 2]), (point, ckpt["version"])
        seen.append((os.waitstatus_to_exitcode(status), ckpt["version"] == version))
    # the children did die at those points (3), the last one wrote its version, and a crash before the
    # rename kept the previous one
    assert [code for code, _ in seen] == [3] * len(points) + [0] and seen[-1][1] and not seen[0][1]


@pytest.mark.claim("resume-bit-identical", "checkpoint-write-atomic")
@pytest.mark.timeout(600)  # 4 process starts, seconds of imports each when not forked, more when loaded
def test_three_kill_9s_in_one_run_end_bit_identical(tmp_path):
    """One kill of each kind (kill_resume draws every kind once in each round of three): mid-step, during
    validation, mid-write, then the resume to the end (tests/tools/kill_resume.py --kills 20 is the long check).

    The reference runs in this process. The killed and resumed runs are forks of it (kill_resume.Forked): each
    a process of its own that kill -9 ends, its memory gone with it, so a resume has only the files on disk; a
    fork skips the seconds of imports a new interpreter costs. The fork needs one intra-op thread (OpenMP's
    pool does not survive it: tests/conftest.py sets OMP_NUM_THREADS=1); with more, new interpreters run."""
    reference = tmp_path / "reference"
    assert (
        run_cli("fit", "--config", CONFIGS / "default.yaml", *kill_resume.FLAGS, "--run_dir", reference) == 0
    )
    fork = torch.get_num_threads() == 1
    result = kill_resume.kill_resume(tmp_path, kills=3, seed=1, timeout=150, reference=reference, fork=fork)
    kills = result["kills"]
    assert len(kills) == 3 and [k["landed"] for k in kills] == [k["aimed"]["mode"] for k in kills]
    assert {k["landed"] for k in kills} == {"train", "validation", "write"}
    for kill in kills:
        resumed = kill["resumes_from"]
        if kill["landed"] == "train":
            # killed in the middle of step s+1 (after backward, before the update): the checkpoint written
            # after step s survives and is mid-epoch (a batch of that epoch trained, not all of them)
            assert resumed["global_step"] == kill["aimed"]["step"] == kill["global_step"]
            assert resumed["position"] == kill["batch"] and 0 < kill["batch"] < STEPS
        elif kill["landed"] == "validation":
            # the last checkpoint before an epoch's validation is the mid-epoch one of its second-to-last
            # batch (RunCheckpoint skips the last: the epoch-end save follows validation)
            assert resumed["global_step"] == kill["aimed"]["step"] - 1 and resumed["position"] == STEPS - 1
        else:
            # died with bytes written but not yet renamed: the temporary file stays, and last.ckpt is the
            # previous, complete one (progress() above loaded it)
            assert kill["bytes"] > 0 and kill["tmp_left"], kill
    assert result["problems"] == []


def test_a_run_left_in_the_workdir_by_an_earlier_invocation_is_not_resumed(tmp_path, monkeypatch):
    """`tests/tools/kill_resume.py` defaults to runs/kill_resume: the `killed` run an earlier invocation (of other code,
    perhaps) finished there would otherwise be resumed and compared before any kill of this one."""
    stale = tmp_path / "killed" / "checkpoints" / "last.ckpt"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"an earlier invocation's run")
    (tmp_path / "reference").mkdir()
    seen = []
    monkeypatch.setattr(
        kill_resume, "run_to_end", lambda cmd, cwd, timeout, fork=False: seen.append(stale.exists())
    )
    monkeypatch.setattr(kill_resume, "compare", lambda ref, run: [])
    result = kill_resume.kill_resume(tmp_path, kills=0)
    assert seen == [False, False]  # the reference, then the run to the end: neither found the stale run
    assert result == {"kills": [], "problems": []}
    assert not (tmp_path / "reference").exists()  # made afresh by the reference run (stubbed out here)

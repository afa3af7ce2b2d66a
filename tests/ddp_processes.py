"""Processes for the multi-process tests: start them in a session of their own, wait for several that depend on
each other with a deadline, kill whatever a launcher left behind; or start a node's ranks as torchrun does, each a
fork of the test process (run_ranks)."""

import contextlib
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

from tests.conftest import REPO, environment

# Deadlines. They tell a hang from a slow run and are no performance bar: a hung collective waits out
# configs/ddp.yaml's 10-minute timeout (a rendezvous whose peer never came, 30 min), while one launch of these tests
# takes a minute or two on a small machine shared with other test runs: 5 minutes is about twice the slowest seen.
LAUNCH_DEADLINE_S = 300  # start to exit of one launch (all its processes)
TEST_DEADLINE_S = LAUNCH_DEADLINE_S + 60  # pytest-timeout: the launch plus the in-process work around it
# Once one process of a run has failed, its partners get this long to exit before they are killed: gloo sees the
# peer gone, else Lightning's observer polls every 5 s; a loaded machine adds seconds to that, not minutes.
FAILURE_GRACE_S = 30
# A command that only prints (a launcher script with a stand-in python, make evaluating a variable): well under
# a second, so 30 s only catches a hang.
QUICK_DEADLINE_S = 30


def env_for_children() -> dict:
    # The checkout's `project` and `tests`, whatever directory the processes run in.
    env = environment()  # a copy that a concurrent change cannot break
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    # CPU processes with gloo, as the README's guarantees are tested, on a machine with GPUs too (the commands
    # pick the accelerator themselves: `auto`).
    env["CUDA_VISIBLE_DEVICES"] = ""
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
    procs: list[subprocess.Popen], timeout: float = LAUNCH_DEADLINE_S, grace: float = FAILURE_GRACE_S
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
        reader.join(timeout=QUICK_DEADLINE_S)  # pipes close once the tree is killed
    results = [(p.returncode, *out) for p, out in zip(procs, outputs)]
    if stuck:
        report = "\n\n".join(
            f"process {i} ({'killed, still running' if i in stuck else f'exit {code}'}): {procs[i].args[:4]}...\n"
            f"{out[-1500:]}\n{err[-4000:]}"
            for i, (code, out, err) in enumerate(results)
        )
        pytest.fail(f"not finished {timeout} s after the start, or {grace} s after a failure:\n{report}")
    return results


def finish(proc: subprocess.Popen, timeout: float = LAUNCH_DEADLINE_S) -> tuple[int, str, str]:
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


def torchrun_env(rank: int, world: int, port: int) -> dict[str, str]:
    """The variables torchrun gives rank `rank` of `world` processes on one machine."""
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "LOCAL_WORLD_SIZE": str(world),
    }


def fork_main(args: list[str], log: Path, env: dict | None = None, cwd: Path | None = None) -> int:
    """`python -m project <args>` in a fork of this process; returns its pid. The child writes to `log`, runs with
    `env` as its whole environment (when given) in `cwd`, and never returns into the caller, whatever happens.

    A fork dies to SIGKILL like any process, without the seconds a new interpreter spends importing torch and
    Lightning; only with one intra-op thread (OpenMP's pool does not survive a fork)."""
    sys.stdout.flush(), sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1), os.dup2(fd, 2)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (the child's whole life)
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        if cwd is not None:
            os.chdir(cwd)
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM):
            signal.signal(sig, signal.SIG_DFL)  # the parent's handlers (pytest's) are not the CLI's
        # Lightning reads the launcher's rank from the environment when it is imported (here: before the fork)
        from lightning.pytorch.utilities import rank_zero_only

        rank_zero_only.rank = int(os.environ.get("RANK", "0"))
        from project.__main__ import main

        main(args)
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:  # noqa: BLE001 (printed to the log, as a traceback would be)
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


class Rank:
    """One rank of a run: a fork of this process (fork=True) or a new interpreter, with torchrun's variables.
    What a test needs of a process: pid, poll, kill."""

    def __init__(
        self, args: list[str], rank: int, world: int, port: int, cwd: Path, log: Path, fork: bool
    ) -> None:
        env = env_for_children() | {"OMP_NUM_THREADS": "1"} | torchrun_env(rank, world, port)
        self.returncode: int | None = None
        self._popen = None
        if fork:
            self.pid = fork_main(args, log, env=env, cwd=cwd)
            return
        with open(log, "w") as out:
            self._popen = subprocess.Popen(
                [sys.executable, "-m", "project", *args], cwd=cwd, env=env, stdout=out, stderr=out
            )
        self.pid = self._popen.pid

    def poll(self) -> int | None:
        if self._popen is not None:
            self.returncode = self._popen.poll()
        elif self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def kill(self) -> None:
        """SIGKILL the rank and its loader workers."""
        for pid in [*descendants(self.pid), self.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while self.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)


def run_ranks(args: list[str], cwd: Path, logs: Path, until=None, world: int = 2) -> list[int]:
    """Start the ranks of one node as torchrun does, wait for them (or, with `until`, for until() to hold, then
    SIGKILL them); the exit codes. Fails the test, showing the logs, when the ranks are not done within
    LAUNCH_DEADLINE_S."""
    fork = torch.get_num_threads() == 1
    port = free_port()
    logs.mkdir(parents=True, exist_ok=True)
    ranks = [Rank(args, r, world, port, cwd, logs / f"rank{r}.log", fork) for r in range(world)]
    deadline = time.monotonic() + LAUNCH_DEADLINE_S
    try:
        while any(r.poll() is None for r in ranks) and time.monotonic() < deadline:
            if until is not None and until():
                break
            if any(r.poll() not in (None, 0) for r in ranks):  # a failed rank: give the other a moment
                deadline = min(deadline, time.monotonic() + 30)
            time.sleep(0.05)
    finally:
        stuck = [r for r in ranks if r.poll() is None]
        for r in stuck:
            r.kill()
    if stuck and until is None:
        shown = "\n\n".join(f"rank {i}:\n{(logs / f'rank{i}.log').read_text()[-3000:]}" for i in range(world))
        pytest.fail(f"the ranks did not exit within {LAUNCH_DEADLINE_S} s (a hang?):\n{shown}")
    return [r.returncode for r in ranks]

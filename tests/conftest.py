"""Shared test helpers: the CLI in-process in a temporary directory; the README's commands as subprocesses in a
user checkout, and the session's finished `make train` run."""

import contextlib
import fcntl
import functools
import json
import os
import pty
import re
import select
import shlex
import shutil
import signal
import struct
import subprocess
import termios
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

# One intra-op thread for this process and every process a test starts, unless the caller set one: the suite runs
# three workers on as few as 2 cores, each training in-process and starting processes of its own, and a second
# thread per process mostly spins, waiting for a busy core (it nearly doubles the CPU time of the session's
# `make train`). Set before torch is imported. The tests of the DDP thread split remove it for their processes,
# as a user's shell has none.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from project.__main__ import main  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "configs"
# The documentation: README.md (what to edit and run) and the pages it links in docs/ (the details). Tests that hold
# the text to what the code does (commands, claims, sections) read all of it.
DOC_PAGES = (
    "README.md",
    "docs/data.md",
    "docs/accuracy.md",
    "docs/multi-process.md",
    "docs/resume.md",
    "docs/performance.md",
    "docs/sweeps.md",
    "docs/recipes.md",
    "docs/architecture.md",
)


def documentation() -> str:
    """README.md and its docs/ pages, one text (each section heading appears once in it)."""
    return "\n\n".join((REPO / page).read_text() for page in DOC_PAGES)


# Fast, quiet training flags for end-to-end tests.
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--claim",
        action="append",
        default=[],
        metavar="ID",
        help="run only the tests marked @pytest.mark.claim(ID) (repeatable); tests/tools/mutate.py uses it",
    )


# The longest files first, by their CPU and wall time (tests/tools/cpu_usage.py measures both): `make test` runs
# pytest-xdist workers that take whole files in this order (--no-loadscope-reorder: xdist's default order is the
# most tests first, which left the multi-process files of few tests to end the run on one core). What makes each
# one long:
LONGEST_FIRST = (
    "test_sweep.py",  # real sweeps: every trial a `python -m project fit` process of its own
    "test_torchrun_restart.py",  # a 2-rank job killed and restarted 3 times, then replayed in one process
    "test_ddp.py",  # three multi-process launches, one of two torchrun nodes restarted once
    "test_streaming.py",  # moto's server, in-process prepares and fits
    "test_readme.py",  # the README's commands, each a process of its own in a fresh checkout
    "test_sweep_storage.py",  # workers started at once on each storage, killed workers
    "test_any_dataset.py",  # 2 ranks forked from pytest, 3 in-process fits
    "test_gpu_check.py",  # the GPU check's CPU dry run (`make bench`'s smoke run too) and the pieces it relies on
    "test_ddp_slurm.py",  # scripts/slurm.sbatch under stand-in SLURM commands
    "test_torchvision_heads.py",  # a forward pass of every torchvision classifier on the meta device
    "test_bad_input.py",  # one in-process run per bad input
    "test_sweep_input.py",  # refused and corrected sweeps; one dry run
    "test_cli.py",  # in-process fits, end to end
    "test_resume.py",  # in-process runs stopped and resumed
    "test_streaming_ddp.py",  # three 2-rank runs, the ranks forked from pytest, and a prepare
    "test_checkpoint_s3.py",  # three fits against moto, one killed mid-upload
    "test_run_continues.py",  # the starting command re-run after a kill, a finish, a death, a change
    "test_resume_kill.py",  # 3 kill -9s; the runs are forks of pytest, no imports
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order kept otherwise
    for item in items:  # launching processes takes seconds: every multi-process test is also a slow one
        if item.get_closest_marker("ddp") and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)
    wanted = set(config.getoption("--claim"))
    if not wanted:
        return
    keep, drop = [], []
    for item in items:
        ids = {i for mark in item.iter_markers("claim") for i in mark.args}
        (keep if ids & wanted else drop).append(item)
    config.hook.pytest_deselected(items=drop)
    items[:] = keep


def run_cli(*args: str) -> int:
    """Run `python -m project ...` in this process; return the exit code (0 when it returns normally)."""
    try:
        main([str(a) for a in args])
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 1
    return 0


def quiet_trainer(**kwargs):
    """A Lightning Trainer for in-process tests: no logger, checkpoint, bar or summary unless asked."""
    import lightning as L

    quiet = dict(
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
    )
    return L.Trainer(**{**quiet, **kwargs})


def read_summary(run_dir: Path) -> dict:
    return json.loads((Path(run_dir) / "summary.json").read_text())


@pytest.fixture
def in_tmp(tmp_path, monkeypatch) -> Path:
    """Run from an empty directory, so runs/ lands in tmp_path."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture(autouse=True)
def deterministic_mode_off():
    """Each test starts and ends with torch's deterministic mode off, as a new process has it.
    `trainer.deterministic: true` (configs/default.yaml) turns it on for the process and nothing turns it off: an
    in-process run (a test's, or a session fixture's) handed it to every later test of its worker, where torch.empty
    fills each new tensor with NaN (building every torchvision classifier took 4x as long)."""
    import torch

    torch.use_deterministic_algorithms(False)
    yield
    torch.use_deterministic_algorithms(False)


# -- The README's commands as a user types them (tests/test_readme.py, and the session's finished run) ---------

# What `make` needs from a clone. A user checkout links these to the repository and has its own runs/.
CHECKOUT_ENTRIES = ("Makefile", "configs", "constraints.txt", "project", "pyproject.toml", "scripts", ".venv")
# A README command's launch may take this long (seconds) before its process group is killed: a hang fails the
# test instead of blocking the suite. The slowest launch here, `make train-ddp` on 2 CPU processes, takes tens of
# seconds on a small machine shared with other suites; 5 minutes leaves room for a slower machine.
LAUNCH_TIMEOUT = 300
# Every launch of this session: (command, wall seconds, CPU seconds, exit code), listed at the end of the run.
LAUNCHED: list[tuple[str, float, float, int]] = []
# Escape sequences a terminal interprets (CSI: colours, cursor moves, erase; OSC: titles and links).
ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[()][A-Za-z0-9]|\x1b[=>78]")

# What a terminal does with them, replayed by screen().
CSI = re.compile(r"\x1b\[([0-9;?]*)([A-Za-z])|\x1b\][^\x07]*\x07|\r|\n|[^\x1b\r\n]")


def screen(raw: str, width: int = 120) -> list[str]:
    """The lines a terminal of `width` columns shows after receiving `raw` (scrollback included), right-stripped."""
    rows: list[list[str]] = [[]]
    row = col = 0
    for match in CSI.finditer(raw):
        text, (params, command) = match.group(0), match.groups()
        if command == "A":  # cursor up
            row = max(row - int(params or 1), 0)
        elif command == "K":  # erase in line: 2 = all of it, else from the cursor on
            rows[row][:] = [] if params == "2" else rows[row][:col]
        elif command or text.startswith("\x1b"):  # colours, cursor visibility, links: nothing drawn
            continue
        elif text == "\r":
            col = 0
        elif text == "\n":
            row, col = row + 1, 0
        else:
            if col >= width:  # the terminal wraps a line longer than the screen
                row, col = row + 1, 0
            while len(rows) <= row:
                rows.append([])
            line = rows[row]
            line.extend(" " * (col - len(line)))
            line[col : col + 1] = [text]
            col += 1
        while len(rows) <= row:
            rows.append([])
    return [line for line in ("".join(r).rstrip() for r in rows) if line]


def pytest_terminal_summary(terminalreporter) -> None:
    if LAUNCHED:
        terminalreporter.section("commands launched (wall s, CPU s, exit code)")
        for command, wall, cpu, code in LAUNCHED:
            terminalreporter.write_line(f"{wall:7.1f} {cpu:7.1f} {code:4d}  {command[:150]}")
        walls, cpus = sum(w for _, w, _, _ in LAUNCHED), sum(c for _, _, c, _ in LAUNCHED)
        terminalreporter.write_line(f"{walls:7.1f} {cpus:7.1f}       in all ({len(LAUNCHED)} commands)")


def user_checkout(path: Path) -> Path:
    """`path` made to look like a fresh clone to `make`: the repository's files linked in, runs/ its own.

    The README's commands run there exactly as typed, relative paths included (runs/, images/, data/mine, the
    my_models.py next to the Makefile), and nothing is written into the repository.
    """
    path.mkdir(parents=True, exist_ok=True)
    for name in CHECKOUT_ENTRIES:
        if (REPO / name).exists() and not (path / name).exists():
            (path / name).symlink_to(REPO / name)
    _check_make_environment(path)
    return path


# What make passes down to the commands of `make test`: MAKEFLAGS and friends carry `make test ARGS="..."` (and any
# other variable set on its command line) into every make a test starts, so `make train` there would get pytest's
# flags. A user's shell has none of them.
MAKE_VARIABLES = (
    "MAKEFLAGS",
    "MFLAGS",
    "MAKELEVEL",
    "MAKEOVERRIDES",
    "ARGS",
    "CONFIG",
    "NPROC",
    "NODES",
    "CKPT",
    "INPUT",
    "SPACE",
    "WORKERS",
    "INSTALL",
    "TEST_WORKERS",
    "PORT",
)


def environment() -> dict[str, str]:
    """A copy of os.environ. Copying it is not atomic: os.environ lists its keys, then reads each, and pytest sets
    and deletes PYTEST_CURRENT_TEST in the main thread while tests/test_readme.py copies the environment for its
    launches in threads (a KeyError in one CI run). A key removed in between makes the copy start again."""
    for _ in range(1000):
        try:
            return dict(os.environ)
        except (KeyError, RuntimeError):
            continue
    return dict(os.environ)


def user_environment() -> dict[str, str]:
    """This process's environment as a user's shell would have it: nothing inherited from make."""
    return {k: v for k, v in environment().items() if k not in MAKE_VARIABLES}


@functools.cache
def _check_make_environment(checkout: Path) -> None:
    # `make train` first (re)installs the environment when pyproject.toml or the constraints are newer than it
    # (`make test` does that before pytest starts). Under a bare `pytest` that would be a pip install, offline
    # here, in the middle of a test: say so instead.
    plan = subprocess.run(
        ["make", "-n", "train"], cwd=checkout, env=user_environment(), capture_output=True, text=True
    )
    lines = plan.stdout.strip().splitlines()
    if plan.returncode != 0 or len(lines) != 1 or " -m project fit " not in lines[0]:
        pytest.fail(
            "`make train` would first (re)install the environment (pyproject.toml or constraints.txt is "
            f"newer than it):\n{plan.stdout}{plan.stderr}\nRun `make install` (or the tests through `make test`)."
        )


@dataclass
class Launch:
    """One command run as its own process: what ran, where, how it ended and what it printed."""

    argv: list[str]
    cwd: Path
    returncode: int
    stdout: str  # under a terminal (pty): everything the terminal received, escape sequences removed
    stderr: str  # under a terminal: empty (one stream)
    seconds: float  # wall clock
    cpu_seconds: float  # user + system of the process and the children it waited for (DDP ranks included)
    raw: str = ""  # under a terminal: the bytes as received, escape sequences included

    @property
    def command(self) -> str:
        return shlex.join(self.argv)

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def lines(self, stream: str = "stdout") -> list[str]:
        """Non-empty lines; a terminal's carriage-return redraws count as line ends."""
        return [line.rstrip() for line in re.split(r"[\r\n]+", getattr(self, stream)) if line.strip()]

    def runs(self) -> list[Path]:
        """The run directories under this launch's runs/."""
        runs = self.cwd / "runs"
        return sorted(p for p in runs.iterdir() if p.is_dir()) if runs.is_dir() else []

    def __str__(self) -> str:  # for assertion messages
        tail = "\n".join(self.output.splitlines()[-40:])
        return (
            f"`{self.command}` in {self.cwd}: exit {self.returncode} after {self.seconds:.1f} s "
            f"({self.cpu_seconds:.1f} CPU s)\n{tail}"
        )


def launch(
    argv: list[str],
    cwd: Path,
    env: dict[str, str | None] | None = None,
    terminal: bool = False,
    timeout: float = LAUNCH_TIMEOUT,
) -> Launch:
    """Run argv in cwd in a process group of its own (killed whole, children included, at the timeout).

    terminal=False: stdin from /dev/null, stdout and stderr to pipes (CI, nohup, `| tee`).
    terminal=True: stdin, stdout and stderr on a pseudo-terminal of 120 x 40 (someone typing the command).
    env: variables to set on top of this process's environment (None: remove the variable).
    """
    environ = user_environment()
    for key, value in (env or {}).items():
        if value is None:
            environ.pop(key, None)
        else:
            environ[key] = value
    start = time.monotonic()
    if terminal:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        streams = {"out": master}
        std = {"stdin": slave, "stdout": slave, "stderr": slave}
    else:
        (out_r, out_w), (err_r, err_w) = os.pipe(), os.pipe()
        streams = {"out": out_r, "err": err_r}
        std = {"stdin": subprocess.DEVNULL, "stdout": out_w, "stderr": err_w}
    proc = subprocess.Popen(argv, cwd=cwd, env=environ, start_new_session=True, **std)
    for fd in {std["stdout"], std["stderr"]}:
        os.close(
            fd
        )  # ours: only the process's copies remain, so reading ends when it (and its children) exit
    received = {name: bytearray() for name in streams}
    open_fds = {fd: name for name, fd in streams.items()}
    while open_fds and time.monotonic() - start < timeout:
        ready, _, _ = select.select(list(open_fds), [], [], 1.0)
        for fd in ready:
            try:
                data = os.read(fd, 65536)
            except OSError:  # EIO: the last process holding the terminal has exited
                data = b""
            if data:
                received[open_fds[fd]] += data
            else:
                os.close(fd)
                del open_fds[fd]
    for fd in open_fds:
        os.close(fd)
    code, cpu = _wait(proc, start + timeout)
    out, err = (received.get(name, b"").decode(errors="replace") for name in ("out", "err"))
    if time.monotonic() - start >= timeout:
        err += f"\n[test] killed after {timeout} s"
    wall = time.monotonic() - start
    LAUNCHED.append((shlex.join(argv), wall, cpu, code))
    if terminal:
        return Launch(argv, cwd, code, ANSI.sub("", out), err, wall, cpu, out)
    return Launch(argv, cwd, code, out, err, wall, cpu)


def _wait(proc: subprocess.Popen, deadline: float) -> tuple[int, float]:
    """Exit code and CPU seconds (user + system, children it waited for included) of proc; killed at deadline."""
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() >= deadline:
            _kill_group(proc)
            pid, status, usage = os.wait4(proc.pid, 0)
            break
        time.sleep(0.05)
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
    with contextlib.suppress(ProcessLookupError):  # whatever it left behind in its group goes too
        os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, usage.ru_utime + usage.ru_stime


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def make_argv(command: str, *args: str) -> list[str]:
    """The argv of a README `make ...` line, with `args` appended to its ARGS="..." (or as a new ARGS)."""
    argv = shlex.split(command)
    assert argv[0] == "make", command
    if args:
        extra = " ".join(args)
        at = next((i for i, token in enumerate(argv) if token.startswith("ARGS=")), None)
        if at is None:
            argv.append(f"ARGS={extra}")
        else:
            argv[at] = f"{argv[at]} {extra}"
    return argv


@dataclass
class FinishedRun:
    """A run that `make train` finished: where it ran, its run directory, and the launch (what it printed)."""

    checkout: Path
    dir: Path  # <checkout>/runs/<time>
    launch: Launch

    @property
    def name(self) -> str:
        """runs/<time>, as `make train` printed it and as the README's runs/<run>/... paths spell it."""
        return f"runs/{self.dir.name}"

    def copy_to(self, checkout: Path) -> Path:
        """A copy of the run directory under another checkout's runs/, same name; returns it."""
        copy = checkout / "runs" / self.dir.name
        shutil.copytree(self.dir, copy)
        return copy


# The session's finished run: the README's first command, shortened to 2 epochs through ARGS.
FINISHED_RUN_COMMAND = 'make train ARGS="--trainer.max_epochs 2"'


def modules_at_exit(dump: Path) -> dict[str, str]:
    """Variables for a launch whose Python processes write every module they imported to `dump` when they exit
    (tests/modules_at_exit/sitecustomize.py)."""
    return {"PYTHONPATH": str(REPO / "tests" / "modules_at_exit"), "MODULES_AT_EXIT": str(dump)}


def imported_packages(dump: Path, names: tuple[str, ...]) -> list[str]:
    """Which of the top-level packages `names` the process that wrote `dump` had imported."""
    modules = dump.read_text().split()
    assert "torch" in modules, modules  # the hook saw the command run
    return sorted({m.split(".")[0] for m in modules if m.split(".")[0] in names})


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> FinishedRun:
    """`make train ARGS="--trainer.max_epochs 2"`, typed once per test session in a fresh checkout. Every module it
    imported is listed in <checkout>/modules-at-exit.txt.

    The default configs, nothing removed: Rich progress bar, model summary, TensorBoard + CSV logs, report.png,
    summary.json, both checkpoints and every callback of configs/default.yaml, on the embedded digits data.
    For tests that only read a finished run: its files, its checkpoints, what `make train` printed
    (`finished_run.launch.stdout`). Do not write into it, other tests read it after yours: a tool that writes
    next to a run (predict, export, `python -m project test`) runs on `finished_run.copy_to(user_checkout(tmp))`.
    """

    def make_train(folder: Path) -> dict:
        checkout = user_checkout(folder)
        # One intra-op thread: it often runs next to other launches (tests/test_readme.py starts several at
        # once), and 2 threads per process on 2 busy cores nearly double this run's CPU time.
        env = {"OMP_NUM_THREADS": "1", **modules_at_exit(checkout / "modules-at-exit.txt")}
        result = launch(make_argv(FINISHED_RUN_COMMAND), checkout, env=env)
        return {**{k: getattr(result, k) for k in Launch.__dataclass_fields__}, "cwd": str(result.cwd)}

    done = once_per_session(tmp_path_factory, "finished-run", make_train)
    result = Launch(**{**done, "cwd": Path(done["cwd"])})
    runs = result.runs()
    assert result.returncode == 0 and len(runs) == 1, f"the session's `make train` failed:\n{result}"
    return FinishedRun(result.cwd, runs[0], result)


ONCE: dict[str, dict] = {}


def once_per_session(tmp_path_factory: pytest.TempPathFactory, name: str, make) -> dict:
    """make(an empty folder) -> a JSON record, once per `make test`, not once per pytest-xdist worker: the first
    worker that needs it runs it under a file lock in the folder the workers share and leaves the record there
    for the others (each reads what make left in that worker's folder). A make that raises is tried again by the
    next worker."""
    if name not in ONCE:
        shared = tmp_path_factory.getbasetemp().parent if os.environ.get("PYTEST_XDIST_WORKER") else None
        with locked(shared / f"{name}.lock") if shared else contextlib.nullcontext():
            record = shared / f"{name}.json" if shared else None
            if record is not None and record.is_file():
                ONCE[name] = json.loads(record.read_text())
            else:
                ONCE[name] = make(tmp_path_factory.mktemp(name))
                if record is not None:
                    record.with_suffix(".tmp").write_text(json.dumps(ONCE[name]))
                    record.with_suffix(".tmp").replace(record)
    return ONCE[name]


@contextlib.contextmanager
def locked(path: Path):
    """An exclusive lock on `path` (created) between the processes of this session."""
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def torchvision_resize(x, size):
    """torchvision v2's antialiased resize of a uint8 image as the reference for project.data.normalize.resize.
    torchvision takes torch's uint8 kernel (the one the project always runs) only on AVX2, AVX512 and ARM CPUs;
    elsewhere (ATEN_CPU_CAPABILITY=default) it goes through float32 and rounds, a different function: there the
    reference is the kernel itself."""
    import platform

    import torch
    import torch.nn.functional as F
    from torchvision.transforms.v2 import functional as F2

    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") or platform.machine() in (
        "aarch64",
        "arm64",
    ):
        return F2.resize(x, list(size), antialias=True)
    return F.interpolate(x[None].contiguous(), size=list(size), mode="bilinear", antialias=True)[0]

"""The README's commands, typed as a user types them in a fresh checkout: each as its own process, or, where the
process start would test nothing the session's `make train` (finished_run) does not, in-process from the command
`make -n` prints (in_process: `make doctor`, `make resume`, the debug preset, own model, image folder and offline
CIFAR-10 lines).

`make train`, `make resume`, `make predict`, `make export`, `make doctor`, `make help`, the data and model flags
and the recipes run with the default configs: Rich progress bar, model summary, TensorBoard + CSV, report, summary
and every callback of configs/default.yaml stay on. Only epochs and batch limits shrink, appended to the command's
ARGS. (The bar is what crashed `make train-ddp` on rank 1 while every in-process test passed with
--trainer.enable_progress_bar false: tests/test_ddp.py types it in a terminal.) The commands get
OMP_NUM_THREADS=1, as several run at once (see launch_single).

The commands are read from README.md: every line of its ```bash blocks is in COMMANDS below, with the test that
runs it or the reason it is not run here, and each test looks its command up by its exact text. A command
changed in the README fails here until its test changes with it.

The launches are independent processes. They start together when the first test of this file needs them, at
most as many at a time as there are CPUs (a launch is mostly single-threaded start-up: importing torch and
lightning), and each test reads its own launch's result.
"""

import contextlib
import csv
import io
import json
import logging
import os
import re
import shlex
import subprocess
import sys
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import (
    FINISHED_RUN_COMMAND,
    LAUNCH_TIMEOUT,
    REPO,
    FinishedRun,
    Launch,
    documentation,
    imported_packages,
    launch,
    make_argv,
    modules_at_exit,
    run_cli,
    user_checkout,
    user_environment,
)

# A guard for this process only: every launch has its own timeout (LAUNCH_TIMEOUT), and a test waits at most for
# the launches queued before its own.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(4 * LAUNCH_TIMEOUT)]

README = REPO / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def readme_blocks(language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(documentation()) if lang == language]


def _without_comment(line: str) -> str:
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def readme_commands() -> list[str]:
    """Every command line of the README's ```bash blocks: continuations joined, comments and spacing dropped."""
    commands = []
    for body in readme_blocks("bash"):
        for line in re.sub(r"\\\n\s*", " ", body).splitlines():
            if command := " ".join(_without_comment(line).split()):
                commands.append(command)
    return commands


def readme_command(text: str) -> str:
    """`text`, after checking that the README shows exactly this command."""
    assert text in readme_commands(), f"README.md no longer shows `{text}`: update its test in {__file__}"
    return text


# -- Every README command: the test here that runs it, or why it runs elsewhere or not at all ------------------

IMAGEFOLDER = (
    'make train ARGS="--data.init_args.source imagefolder --data.init_args.root /data/pets '
    '--data.init_args.image_size 64"'
)
CIFAR10 = 'make train ARGS="--data.init_args.source cifar10 --data.init_args.root data --data.init_args.download true"'
EVALUATE = "python -m project test --config configs/default.yaml --ckpt_path runs/<run>/checkpoints/last.ckpt"
TORCHRUN = "scripts/torchrun.sh --nnodes 2 --node_rank {} --master_addr <node0> --run_id exp1 -- --trainer.max_epochs 5"
PRESET = 'make train ARGS="--config configs/debug/profiler.yaml --config configs/debug/limit_batches.yaml"'
FINETUNE = (
    'make train ARGS="--config configs/finetune.yaml --model.init_args.model.init_args.name resnet18 '
    '--data.init_args.source imagefolder --data.init_args.root data/mine --data.init_args.image_size 224"'
)
COMMANDS = {
    "make train": "test_make_train (the session's finished_run, 2 epochs)",
    "make test": "not run here: it is this test suite (CI runs it: bash .ci/run)",
    'make train ARGS="--config mine.yaml"': "test_own_model (in-process: the command `make -n` prints)",
    IMAGEFOLDER: "test_imagefolder (in-process: the command `make -n` prints)",
    CIFAR10: "test_cifar10_download_needs_network (in-process: the command `make -n` prints)",
    'make train ARGS="--model lightning.pytorch.demos.BoringModel --data lightning.pytorch.demos.BoringDataModule"': "not run here: tests/test_any_module.py runs it as shown (3 "
    "epochs) in a fresh checkout (readme_train_run) and asserts on its run",
    "make train CONFIG=configs/sequence.yaml": "not run here: tests/test_any_dataset.py runs it as shown (3 epochs) "
    "in a fresh checkout (readme_train_run) and asserts on its run",
    "make train-ddp CONFIG=configs/sequence.yaml": "not run here: tests/test_any_dataset.py runs the fit it makes "
    "(configs/sequence.yaml + configs/ddp.yaml, 2 CPU processes) with the DDP probe callback",
    "python -m project test --config configs/sequence.yaml --ckpt_path runs/<run>/checkpoints/last.ckpt": "not run "
    "here: tests/test_any_dataset.py runs the same arguments in-process on its sequence run's checkpoint",
    # docs/data.md "Data that outgrows one machine": tests/test_streaming.py, against moto's S3 server on 127.0.0.1.
    "make prepare SOURCE=imagefolder ROOT=/data/pets OUTPUT=/data/pets-stream IMAGE_SIZE=64": "not run here: "
    "tests/test_streaming.py runs the command it prints in-process on a folder it writes (re-runs included)",
    'make train ARGS="--data project.data.StreamingDataModule --data.init_args.input_dir /data/pets-stream"': "not "
    "run here: the s3:// line below with a local input_dir; tests/test_streaming.py trains from a local one in-process",
    "make prepare SOURCE=imagefolder ROOT=/data/pets OUTPUT=s3://my-bucket/pets IMAGE_SIZE=64": "not run here: "
    "tests/test_streaming.py (test_readme_s3_commands) runs the command it prints in-process, to moto's server",
    'make train ARGS="--data project.data.StreamingDataModule --data.init_args.input_dir s3://my-bucket/pets"': "not "
    "run here: tests/test_streaming.py (test_readme_s3_commands) runs it as typed, one epoch, from moto's server",
    EVALUATE: "not run here: tests/test_cli.py runs the same `python -m project test` arguments in-process",
    "make train-ddp": "not run here: tests/test_ddp.py types the same target with the ARGS of the line below",
    'make train-ddp NPROC=4 ARGS="--trainer.max_epochs 5"': "test_make_help (with make -n: 4 processes do not fit "
    "2 cores; NPROC=2 runs in tests/test_ddp.py)",
    'make train-ddp ARGS="--model.init_args.lr_scaling linear"': "not run here: tests/test_ddp.py "
    "(test_make_train_ddp_two_cpu_processes_in_a_terminal) types it in a terminal in a fresh checkout, 2 epochs, "
    "with the DDP probe callback",
    TORCHRUN.format(0): "not run here: two machines (tests/test_ddp.py runs two torchrun.sh nodes on one)",
    TORCHRUN.format(1): "not run here: two machines (tests/test_ddp.py runs two torchrun.sh nodes on one)",
    "make resume": "test_resume (in-process: the command `make -n` prints)",
    'make train ARGS="--ckpt_path runs/<run>/checkpoints/last.ckpt"': "not run here: `make resume` passes "
    "--ckpt_path through ARGS the same way; tests/test_resume.py resumes from that path in-process",
    'make train ARGS="--checkpoint_every_n_steps 50"': "not run here: 50 steps are 2.5 full epochs; "
    "--checkpoint_every_n_steps is tested in tests/test_resume.py",
    'make train ARGS="--config configs/logger/wandb.yaml"': "not run here: as a process of its own it is among the "
    'costliest commands (README "Tests"); tests/trained_run.py runs this overlay in-process with the default '
    "configs (progress bar on) for tests/test_loggers.py, and tests/test_wandb_resume.py checks the offline hint "
    "without a key",
    "make train && xdg-open runs/<run>/report.png": "test_report (xdg-open is not run: no display)",
    "make predict CKPT=runs/<run>/checkpoints/last.ckpt INPUT=images/": "test_predict",
    "make export CKPT=runs/<run>/checkpoints/last.ckpt": "test_export",
    "make doctor": "test_doctor (in-process: the command `make -n` prints)",
    "make tensorboard": "not run here: tests/test_tensorboard.py runs it as typed (plus a free PORT) on the session's "
    "finished run and queries the server",
    PRESET: "test_debug_preset (in-process: the command `make -n` prints)",
    # Sweeps: every trial is a `make train` process (a new interpreter: seconds of imports, then a fit and a test),
    # so the sweeps run in tests/test_sweep.py with a test sweep file of 2 epochs x 4 batches and 1-2 trials.
    "make sweep": "not run here: 20 trials of 5 epochs; tests/test_sweep.py runs `make sweep SPACE=<its sweep "
    "file>` (same target and code path) with fewer trials, epochs and batches",
    "make sweep WORKERS=2": "not run here: tests/test_sweep.py runs the command it prints with --workers 2 "
    "(killed, then resumed)",
    'make sweep ARGS="--n_trials 30"': "not run here: tests/test_sweep.py resumes a killed sweep with the same "
    "command; --n_trials is the same flag its sweep file's n_trials stands for",
    'make train ARGS="--config runs/sweeps/digits/best.yaml"': "not run here: tests/test_sweep.py runs the fit "
    '`make train ARGS="--config runs/sweeps/t/best.yaml"` makes, in-process, on its own sweep and compares the metric',
    "python -m project sweep --report": "not run here: tests/test_sweep.py runs it with the --space/--dir of its "
    "own sweep",
    "python -m project sweep --storage postgresql://user:password@db-host/optuna --worker_index 1": "not run "
    "here: no database server; tests/test_sweep.py runs a worker on a journal storage",
    "sbatch --array=0-7 scripts/sweep_slurm.sbatch --storage postgresql://user:password@db-host/optuna": "not run "
    "here: no SLURM, no database; tests/test_sweep.py runs the script as array task 3 with a journal storage",
    FINETUNE: "not run here: resnet18 at 224 pixels costs more than any other command (README "
    '"Tests"); tests/test_finetune.py runs configs/finetune.yaml with cached weights in-process',
    "make train INSTALL=0": "not run here: tests/test_gpu_check.py runs `make -n train INSTALL=0` (the check, then "
    "the same fit as test_make_train) and the check itself against this environment",
    "scripts/gpu_check.sh --prepare": "not run here: it downloads from a package registry; tests/test_gpu_check.py "
    "builds the same wheels offline from this environment and installs them the same way",
    "scripts/gpu_check.sh": "not run here: it needs a CUDA GPU; its --dry-run runs the same stages",
    "scripts/gpu_check.sh --dry-run": "not run here: tests/test_gpu_check.py (test_gpu_check_dry_run) runs it as "
    "typed, in a fresh checkout",
}

# Only epochs shrink (appended to ARGS).
ONE_EPOCH = ("--trainer.max_epochs 1",)
# No network, whatever the machine: downloads fail at once (the discard port of this host) instead of fetching.
OFFLINE = {"http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9", "no_proxy": ""}
OFFLINE |= {k.upper(): v for k, v in OFFLINE.items()}


@pytest.mark.claim("readme-commands-tested")
def test_every_readme_command_is_run_or_accounted_for():
    commands = readme_commands()
    assert commands, "no ```bash block found in README.md"
    new = [c for c in commands if c not in COMMANDS]
    gone = [c for c in COMMANDS if c not in commands]
    assert not new, (
        f"README commands with no test here: {new}. Add each to COMMANDS with the test that runs it."
    )
    assert not gone, f"COMMANDS lists commands the README no longer shows: {gone}"
    for command, where in COMMANDS.items():
        assert where.startswith(("test_", "not run here: ")), f"{command}: {where}"
        names = re.findall(r"\btest_\w+", where.split("(")[0]) if where.startswith("test_") else []
        assert all(name in globals() for name in names), f"{command}: no test {names} in this file"


# -- The launches ------------------------------------------------------------------------------------------------


def needs(*names: str):
    """Mark a test with the launches it reads (the module's fixture starts those of the selected tests)."""

    def mark(test):
        test.launches = names
        return test

    return mark


def written(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def write_images(root: Path, per_class: int = 50) -> Path:
    """root/train/{cat,dog}/*.png: 8x8 RGB, dark cats and bright dogs. 100 images: 30% go to val and test, and
    the 70 left fill one training batch of the default 64 (a smaller training split is an error)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for label, name in enumerate(("cat", "dog")):
        folder = root / "train" / name
        folder.mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 80, (8, 8, 3)) + 150 * label
            Image.fromarray(pixels.astype("uint8")).save(folder / f"{i}.png")
    return root


# Several commands run at once here, on as few as 2 cores: a single-process command gets one intra-op thread, so
# that 3 processes do not spin 6 threads on 2 cores (on shared cores a second thread mostly waits for a busy core,
# and nearly doubles the CPU time of the session's `make train`).


def launch_single(argv: list[str], checkout: Path, env: dict | None = None) -> Launch:
    return launch(argv, checkout, env={"OMP_NUM_THREADS": "1", **(env or {})})


def launch_predict(checkout: Path, run: str) -> Launch:
    from PIL import Image

    from project.data.digits import load_digits_tensors

    images, _ = load_digits_tensors()  # three real digits, and a file that is not an image
    written(checkout / "images/notes.txt", "not an image\n")
    for i in range(3):
        Image.fromarray((images[i, 0] * 255).round().byte().numpy()).save(checkout / f"images/{i}.png")
    command = readme_command("make predict CKPT=runs/<run>/checkpoints/last.ckpt INPUT=images/")
    return launch_single(
        make_argv(command.replace("<run>", run)), checkout, modules_at_exit(checkout / "predict.txt")
    )


def launch_export(checkout: Path, run: str) -> Launch:
    command = readme_command("make export CKPT=runs/<run>/checkpoints/last.ckpt")
    return launch_single(
        make_argv(command.replace("<run>", run)), checkout, modules_at_exit(checkout / "export.txt")
    )


def launch_help(checkout: Path) -> list[Launch]:
    nproc4 = make_argv(readme_command('make train-ddp NPROC=4 ARGS="--trainer.max_epochs 5"'))
    return [
        launch_single(["make", "help"], checkout),
        launch_single([nproc4[0], "-n", *nproc4[1:]], checkout),
    ]


# name -> (what starts it, whether it runs on a copy of the session's finished run). Listed longest first.
LAUNCHES = {
    "help": (launch_help, False),
    "export": (launch_export, True),
    "predict": (launch_predict, True),
}


class Launched:
    """The launches of the selected tests, started at once; `launched["name"]` waits for one."""

    def __init__(self, workers: int) -> None:
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="readme")
        self.futures: dict[str, Future] = {}
        self.tools: Path | None = None  # the checkout holding a copy of the finished run

    @property
    def tools_run(self) -> Path:
        """The copy of the finished run that predict and export work on."""
        (run,) = (self.tools / "runs").iterdir()
        return run

    def __getitem__(self, name: str):
        return self.futures[name].result()


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory) -> Launched:
    wanted = set()
    for item in request.session.items:
        if item.module is request.module:
            wanted |= set(getattr(item.function, "launches", ()))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    result = Launched(workers=cpus + 1)
    try:
        for name, (start, on_copy) in LAUNCHES.items():
            if name in wanted and not on_copy:
                checkout = user_checkout(tmp_path_factory.mktemp(name))
                result.futures[name] = result.pool.submit(start, checkout)
        if any(LAUNCHES[name][1] for name in wanted):
            # This process runs the session's `make train` meanwhile (unless an earlier test already needed it).
            run: FinishedRun = request.getfixturevalue("finished_run")
            result.tools = user_checkout(tmp_path_factory.mktemp("tools"))
            run.copy_to(result.tools)
            for name, (start, on_copy) in LAUNCHES.items():
                if name in wanted and on_copy:
                    result.futures[name] = result.pool.submit(start, result.tools, run.dir.name)
        yield result
    finally:
        result.pool.shutdown(wait=True, cancel_futures=True)


def in_process(command: str, checkout: Path, monkeypatch, *args: str) -> int:
    """A README `make` line (readme_command's; `args` appended to its ARGS) as `make -n` prints it, run in this process from
    `checkout`: the exit code. For commands whose process start (seconds of imports) tests nothing that the session's
    `make train` (finished_run) does not."""
    argv = make_argv(command, *args)
    # user_environment: not `make test`'s MAKEFLAGS, whose ARGS would reach this make
    printed = subprocess.run(
        [argv[0], "-n", *argv[1:]],
        cwd=checkout,
        capture_output=True,
        text=True,
        check=True,
        env=user_environment(),
    )
    (line,) = printed.stdout.splitlines()
    python, *args = shlex.split(line)
    assert python == ".venv/bin/python" and args[:2] == ["-m", "project"], line
    monkeypatch.chdir(checkout)
    monkeypatch.syspath_prepend(str(checkout))  # as `python -m` puts the working directory first
    return run_cli(*args[2:])


def launched_in_process(command: str, checkout: Path, *args: str) -> Launch:
    """A README `make` line run by in_process, as a Launch: its exit code and what it printed (Lightning's log
    lines included, on stderr as a process has them)."""
    out, err = io.StringIO(), io.StringIO()
    lightning_log, handler = logging.getLogger("lightning.pytorch"), logging.StreamHandler(err)
    lightning_log.addHandler(handler)
    try:
        with (
            pytest.MonkeyPatch.context() as mp,
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
        ):
            code = in_process(command, checkout, mp, *args)
    finally:
        lightning_log.removeHandler(handler)
    return Launch(shlex.split(command), checkout, code, out.getvalue(), err.getvalue(), 0.0, 0.0)


def trained_in_process(command: str, checkout: Path, *args: str) -> Path:
    """A README `make train` line run by in_process: its run directory, after check_run's checks on what it
    printed (exit 0, one run directory, named on the last line, no traceback)."""
    return check_run(launched_in_process(command, checkout, *args))


def summary_of(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def readme_train_run(tmp_path_factory, name: str, command: str, epochs: int) -> Path:
    """A `make train` command the README shows, in a fresh checkout with `--trainer.max_epochs` appended, run
    in-process (trained_in_process): the run directory it made."""
    return trained_in_process(
        command, user_checkout(tmp_path_factory.mktemp(name)), f"--trainer.max_epochs {epochs}"
    )


def check_run(result: Launch) -> Path:
    """A training launch that worked: exit 0, one run directory, printed as the last line, no traceback."""
    assert result.returncode == 0, result
    runs = result.runs()
    assert len(runs) == 1, f"expected one run directory, found {runs}\n{result}"
    assert "Traceback" not in result.output, result
    assert result.lines()[-1] == f"Run directory: runs/{runs[0].name}", result
    return runs[0]


# -- make train and the files it leaves --------------------------------------------------------------------------


@pytest.mark.claim(
    "train-prints-run-dir",
    "run-dir-layout",
    "summary-keys",
    "make-help-lists-targets",
    "summary-printed-first-and-next",
)
def test_make_train(finished_run: FinishedRun):
    result = finished_run.launch
    run = check_run(result)
    assert run == finished_run.dir
    # make prints the command it runs, then the run prints its progress bar, its summary table and the run dir.
    args = shlex.split(FINISHED_RUN_COMMAND)[2].removeprefix("ARGS=")
    command = f".venv/bin/python -m project fit --config configs/default.yaml {args}"
    assert result.lines()[0] == command, result
    bars = re.findall(r"^Epoch 1/1\b.*━.* (\d+)/(\d+) ", result.stdout, re.M)  # the bar's last state
    assert bars and bars[-1][0] == bars[-1][1], result
    # Piped: no live redraws of the bar (tests/test_ddp.py types `make train-ddp` in a terminal).
    assert "\x1b[?25l" not in result.output, result
    lines = result.lines()
    table = lines[max(i for i, line in enumerate(lines) if "Run summary" in line) : -1]
    assert any("test_acc " in line for line in table), result
    assert any("best_checkpoint" in line for line in table), result
    # The verdict first, then the report and the next commands, the run directory last.
    rows = [line.split("│")[1].strip() for line in table if line.count("│") >= 3]
    assert rows[:2] == ["test_acc", "test_loss"], rows
    best = summary_of(run)["best_checkpoint"]
    assert (
        lines[-3]
        == f"Report: runs/{run.name}/report.png (curves, learning rate, confusion matrix, wrong images)"
    )
    assert (
        lines[-2].startswith("Next: make tensorboard")
        and f"make predict CKPT=runs/{run.name}/checkpoints/" in lines[-2]
    )
    assert Path(best).name in lines[-2], (lines[-2], best)
    # The run directory as the README lists it.
    names = {str(p.relative_to(run)) for p in run.rglob("*") if p.is_file()}
    expected = {
        "config.yaml",
        "checkpoints/last.ckpt",
        "hparams.yaml",
        "metrics.csv",
        "report.png",
        "summary.json",
    }
    assert expected <= names, names
    assert any(re.fullmatch(r"checkpoints/best-epoch=\d{3}\.ckpt", n) for n in names), names
    assert any(n.startswith("events.out.tfevents.") for n in names), names
    summary = summary_of(run)
    keys = "best_val_acc test_acc test_loss test_acc_top5 best_checkpoint last_checkpoint epochs global_step seed"
    assert set(keys.split()) | {"train_seconds"} <= set(summary), summary
    assert (summary["epochs"], summary["seed"]) == (2, 0), summary
    # Nothing the user cannot act on: the library deprecation notices project/console.py drops stay dropped.
    assert "deprecated" not in result.stderr, result.stderr


@pytest.mark.claim("run-report")
def test_report(finished_run: FinishedRun):
    from PIL import Image

    with Image.open(finished_run.dir / "report.png") as image:
        image.load()
        # RunReport's defaults: a 15 x 10 inch figure at dpi 80.
        assert (image.format, image.size) == ("PNG", (15 * 80, 10 * 80))


# -- Never lose a run ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def preset_then_resume(tmp_path_factory) -> list[tuple[Launch, dict]]:
    """The debug preset (2 epochs x 5 batches), then `make resume` to epoch 3, in-process (launched_in_process):
    each with the summary.json it left (the resume rewrites it). No resume after a failed preset."""
    checkout = user_checkout(tmp_path_factory.mktemp("preset"))
    limits = "--trainer.limit_train_batches 5 --trainer.limit_val_batches 2 --trainer.limit_test_batches 2"
    done = []
    for command, args in ((PRESET, ()), ("make resume", ("--trainer.max_epochs 3", limits))):
        result = launched_in_process(readme_command(command), checkout, *args)
        runs = result.runs()
        done.append((result, summary_of(runs[0]) if result.returncode == 0 and len(runs) == 1 else {}))
        if not done[-1][1]:
            break
    return done


@pytest.mark.claim("debug-preset-profiler")
def test_debug_preset(preset_then_resume):
    preset, summary = preset_then_resume[0]
    run = check_run(preset)
    # configs/debug/limit_batches.yaml: 2 epochs x 5 batches
    assert (summary["epochs"], summary["global_step"]) == (2, 10), summary
    profile = (run / "fit-profile.txt").read_text()  # SimpleProfiler's table, written at the end of fit
    assert "run_training_batch" in profile, profile[:2000]


@pytest.mark.claim("resume-continues-own-run", "resume-as-started")
def test_resume(preset_then_resume):
    launches = preset_then_resume
    assert len(launches) == 2, launches[-1][0]
    run = check_run(launches[0][0])
    resumed, summary = launches[1]
    # In the same run directory (no second one), from its last.ckpt: one more epoch of 5 steps.
    assert check_run(resumed) == run
    assert (summary["epochs"], summary["global_step"]) == (3, 15), summary
    assert "Restored all states from the checkpoint" in resumed.stderr, resumed
    # The same TensorBoard folder; the earlier metrics.csv kept as metrics.1.csv.
    assert len(list(run.glob("events.out.tfevents.*"))) >= 2
    assert {p.name for p in run.glob("metrics*.csv")} == {"metrics.csv", "metrics.1.csv"}
    # As it was started: the preset's profiler and batch limits came from the run's config.yaml, not from
    # configs/default.yaml; the flags of the command are the recorded changes.
    assert (
        f"Resuming {run.relative_to(resumed.cwd)} as it was started: its config.yaml; changed by this command: --trainer.max_epochs 3"
        in resumed.stdout + resumed.stderr
    )
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["trainer"]["profiler"]["class_path"] == "lightning.pytorch.profilers.SimpleProfiler"
    (record,) = [json.loads(line) for line in (run / "resumes.jsonl").read_text().splitlines()]
    assert record["changes"][:2] == ["--trainer.max_epochs", "3"]


# -- Fill in your model, point at your own data -------------------------------------------------------------------


@pytest.mark.claim("own-model-from-config")
def test_own_model(tmp_path):
    checkout = user_checkout(tmp_path)
    # my_models.py and mine.yaml exactly as the README shows them, next to the Makefile.
    for body in readme_blocks("python") + readme_blocks("yaml"):
        first = body.splitlines()[0]
        if first in ("# my_models.py", "# mine.yaml"):
            written(checkout / first[2:], body)
    sys.modules.pop("my_models", None)  # another test's my_models.py, imported in this process
    try:
        run = trained_in_process(readme_command('make train ARGS="--config mine.yaml"'), checkout, *ONE_EPOCH)
        assert Path(sys.modules["my_models"].__file__) == checkout / "my_models.py"
    finally:
        sys.modules.pop("my_models", None)
    config = json.dumps(yaml.safe_load((run / "config.yaml").read_text())["model"])
    assert '"class_path": "my_models.TinyMLP"' in config and '"hidden": 32' in config, config
    weights = torch.load(run / "checkpoints/last.ckpt", weights_only=True)["state_dict"]
    # 8x8 grey digits flattened to 64 inputs, hidden 32 (mine.yaml), 10 classes filled in from the data.
    assert weights["model.net.1.weight"].shape == (32, 64) and weights["model.net.3.weight"].shape == (10, 32)


@pytest.mark.claim("own-data-imagefolder")
def test_imagefolder(tmp_path):
    checkout = user_checkout(tmp_path)
    pets = write_images(checkout / "pets")
    run = trained_in_process(
        readme_command(IMAGEFOLDER).replace("/data/pets", str(pets)), checkout, *ONE_EPOCH
    )
    ckpt = torch.load(run / "checkpoints/last.ckpt", weights_only=True)
    (data,) = [v for k, v in ckpt.items() if k.endswith("ImageClassificationDataModule")]
    assert data["class_names"] == ["cat", "dog"] and data["input_shape"] == [3, 64, 64], data


@pytest.mark.claim("cifar10-download-offline")
def test_cifar10_download_needs_network(tmp_path, monkeypatch, capsys):
    for var, value in OFFLINE.items():
        monkeypatch.setenv(var, value)
    # urlopen's shared opener reads the proxy variables once, when first built: the one built here goes after the test
    monkeypatch.setattr(urllib.request, "_opener", None)
    checkout = user_checkout(tmp_path)
    assert (
        in_process(readme_command(CIFAR10), checkout, monkeypatch) == 2
    )  # a user error's exit code; make adds "Error 2"
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    message = " ".join(line for line in err.splitlines() if line.startswith("error:"))
    assert "CIFAR10 train files were not found or are corrupt under 'data/cifar-10-batches-py'" in message
    assert "The download failed: is this machine online? Otherwise copy the files there by hand." in message
    assert not (checkout / "runs").exists() or not list(
        (checkout / "runs").iterdir()
    )  # no run directory left


# -- Recipes -------------------------------------------------------------------------------------------------------


# Lightning (seconds to import), torchmetrics and matplotlib belong to training; torchvision (over a second more)
# only to torchvision models: predict and export start without them.
TRAINING_STACK = ("lightning", "pytorch_lightning", "torchmetrics", "matplotlib")


@pytest.mark.claim("predict-csv", "tools-start-fast")
@needs("predict")
def test_predict(launched):
    result = launched["predict"]
    assert result.returncode == 0, result
    assert imported_packages(launched.tools / "predict.txt", (*TRAINING_STACK, "torchvision")) == []
    run = launched.tools_run
    assert f"Predicted 3 image(s) -> runs/{run.name}/predictions.csv" in result.lines(), result
    assert "Skipped 1 file(s), not readable images:" in result.stderr and "notes.txt" in result.stderr
    rows = list(csv.reader((run / "predictions.csv").open()))
    assert rows[0] == ["path", "class", "probability", "top3"]
    assert sorted(Path(r[0]).name for r in rows[1:]) == ["0.png", "1.png", "2.png"], rows
    for _, label, probability, top in rows[1:]:
        names, probabilities = zip(*(pair.split(":") for pair in top.split(";")), strict=True)
        assert names[0] == label and label in "0123456789", top
        # The same probability, printed with 6 decimals and with 4 in the top-k column: within half the 4th's unit.
        assert abs(float(probabilities[0]) - float(probability)) <= 0.5e-4, top
        assert list(map(float, probabilities)) == sorted(map(float, probabilities), reverse=True), top


@pytest.mark.claim("export-checked", "tools-start-fast")
@needs("export")
def test_export(launched):
    result = launched["export"]
    assert result.returncode == 0, result
    assert imported_packages(launched.tools / "export.txt", TRAINING_STACK) == []
    out = launched.tools_run / "export"
    assert {"model.onnx", "preprocessing.json"} <= {p.name for p in out.iterdir()}, sorted(out.iterdir())
    diffs = [float(d) for d in re.findall(r"max abs diff (\S+)", result.stdout)]
    assert len(diffs) >= 2 and max(diffs) <= 1e-4, result  # the README's bound for each printed difference


@pytest.mark.claim("doctor-verdict")
def test_doctor(tmp_path, monkeypatch, capsys):
    assert in_process(readme_command("make doctor"), user_checkout(tmp_path), monkeypatch) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "doctor: ready for `make train`.", lines
    assert any(line.startswith("ok:") for line in lines), lines
    assert not any(line.startswith("problem:") for line in lines), lines


@pytest.mark.claim("make-help-lists-targets")
@needs("help")
def test_make_help(launched):
    listing, nproc4 = launched["help"]
    assert listing.returncode == 0, listing
    phony = re.search(r"^\.PHONY:(.*)$", (REPO / "Makefile").read_text(), re.M).group(1).split()
    listed = [line.split()[1] for line in listing.lines() if line.startswith("  make ")]
    assert sorted(listed) == sorted(phony), listing
    # Each target prints the command it runs; NPROC and ARGS reach it.
    assert nproc4.returncode == 0 and nproc4.lines() == [
        ".venv/bin/python -m project fit --config configs/default.yaml --config configs/ddp.yaml "
        "--trainer.devices 4 --trainer.num_nodes 1 --trainer.max_epochs 5"
    ], nproc4


@pytest.mark.claim("readme-commands-tested")
def test_readme_parser_reads_what_the_readme_shows():
    # The parser on the README's own forms: a comment after a command, a continuation, quotes holding spaces.
    assert "make resume" in readme_commands() and FINETUNE in readme_commands()
    assert _without_comment('make x ARGS="a # b"  # note') == 'make x ARGS="a # b"  '
    assert make_argv('make train ARGS="--a 1"', "--b 2") == ["make", "train", "ARGS=--a 1 --b 2"]
    assert make_argv("make doctor", "--b 2") == ["make", "doctor", "ARGS=--b 2"]

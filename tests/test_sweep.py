"""`make sweep`: an Optuna study whose trials are `make train` runs (project/sweep/), offline, on CPU.

Real sweeps cover the README's claims, each trial a real `python -m project fit` process with the default configs
(progress bar, loggers, every callback on); only epochs and batch limits shrink, in the test's sweep file. Their
input check (keys, values, the metric's dry run) is a stub returning what the real one finds for these sweep files
(tests/stub_trials/sitecustomize.py): tests/test_sweep_input.py runs the real one. The killed sweep, whose subject
is the workers' bookkeeping, runs stub trials too. Every process runs with OMP_NUM_THREADS=1: the best trial's re-run
must use the trials' thread count to give the same bits, and several processes share 2 cores here.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import sqlalchemy
import yaml
from optuna.trial import TrialState

from tests.conftest import launch, make_argv, run_cli, user_checkout, user_environment
from tests.stub_trials.sitecustomize import stub_environment

pytestmark = [pytest.mark.slow]

LR = "model.init_args.optimizer.init_args.lr"
SMOOTHING = "model.init_args.label_smoothing"
WIDTH = "model.init_args.model.init_args.width"
# Only epochs and batch limits shrink: 2 epochs (pruning can stop a trial after the first) of 4 batches.
FAST = {
    "trainer.max_epochs": 2,
    "trainer.limit_train_batches": 4,
    "trainer.limit_val_batches": 2,
    "trainer.limit_test_batches": 2,
}
THREADS = {"OMP_NUM_THREADS": "1"}
# A sweep launch here runs 3-4 trial processes, each a new interpreter (seconds of imports, then a fit and a test),
# and cores shared with other suites can stretch a trial's wall time several times over: 8 minutes stops a hang,
# not a slow run.
SWEEP_TIMEOUT = 480


def write_space(path: Path, **overrides) -> Path:
    space = {
        "name": "t",
        "n_trials": 2,
        "enqueue_base": False,
        "sampler": {"class_path": "optuna.samplers.RandomSampler", "init_args": {"seed": 0}},
        # Prune from the first epoch once one trial has completed: a trial whose first val/loss is above the
        # completed trial's is stopped there.
        "pruner": {
            "class_path": "optuna.pruners.MedianPruner",
            "init_args": {"n_startup_trials": 1, "n_warmup_steps": 0},
        },
        "fixed": dict(FAST),
        "params": {
            # the sampler's range; the test queues values outside it too (Optuna runs an enqueued value as given)
            LR: {"type": "float", "low": 1.0e-4, "high": 1.0e-2, "log": True},
            SMOOTHING: {"type": "float", "low": 0.0, "high": 0.2},
        },
        **overrides,
    }
    path.write_text(yaml.safe_dump(space, sort_keys=False))
    return path


def study_of(sweep_dir: Path, name: str = "t") -> optuna.Study:
    """The study as a reader opens it: through open_storage, which loads a schema another process created meanwhile
    (reading while the sweep starts raced on it: "table studies already exists")."""
    from project.sweep.storage import default_storage, open_storage

    return optuna.load_study(study_name=name, storage=open_storage(default_storage(sweep_dir)))


def summary(run_dir: Path) -> dict:
    import json

    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.timeout(2 * SWEEP_TIMEOUT)
@pytest.mark.claim(
    "sweep-results", "sweep-best-reruns", "sweep-failed-trial", "sweep-pruning", "sweep-report"
)
def test_sweep_results_failed_and_pruned_trials_and_best_rerun(tmp_path, monkeypatch):
    """`make sweep` with three trials queued first: the default lr (completes), lr 1e9 (diverges: val/loss NaN
    after the first epoch), lr 1e-7 (its first val/loss stays at the untrained net's, above the first trial's:
    pruned after epoch 0 of 2). n_trials 2: the sweep ends when two have finished (complete or pruned), the
    failed one not counted."""
    checkout = user_checkout(tmp_path / "clone")
    space = write_space(tmp_path / "t.yaml")
    sweep_dir = checkout / "runs" / "sweeps" / "t"
    sweep_dir.mkdir(parents=True)
    study = optuna.create_study(
        study_name="t", storage=f"sqlite:///{sweep_dir / 'study.db'}", direction="minimize"
    )
    for lr in (0.003, 1e9, 1e-7):
        study.enqueue_trial({LR: lr, SMOOTHING: 0.1})

    run = launch(
        make_argv(f"make sweep SPACE={space}", "--dir runs/sweeps/t"),
        checkout,
        env={**THREADS, **stub_environment(None)},  # val/loss, minimize, no base trial (enqueue_base false)
        timeout=SWEEP_TIMEOUT,
    )
    assert run.returncode == 0, str(run)
    trials = study_of(sweep_dir).get_trials()
    states = [t.state for t in trials]
    assert states == [TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED], str(run)
    # every trial is a run directory of its own, with what `make train` writes
    dirs = sorted(p.name for p in (sweep_dir / "trials").iterdir())
    assert dirs == [f"{t.number:03d}" for t in trials], dirs
    for name in ("config.yaml", "metrics.csv", "console.log", "sweep_trial.yaml"):
        assert (sweep_dir / "trials" / "000" / name).is_file(), name
    assert summary(sweep_dir / "trials" / "000")["best_score"] == trials[0].value
    # the diverged trial: failed with its reason, and the sweep went on
    assert "val/loss is nan" in trials[1].user_attrs["error"], trials[1].user_attrs
    # the pruned trial stopped after its first epoch of 2, without testing
    pruned = sweep_dir / "trials" / "002"
    assert trials[2].system_attrs["ddp_pl:pruned"] and not (pruned / "summary.json").exists()
    assert max(trials[2].intermediate_values) == 0, trials[2].intermediate_values
    # results: table on the console, CSV, best.yaml, PNG
    for name in ("trials.csv", "best.yaml", "report.png", "curves.png"):
        assert (sweep_dir / name).is_file(), name
    assert len((sweep_dir / "trials.csv").read_text().splitlines()) == 1 + len(trials)
    assert "Sweep 't': val/loss (minimize)" in run.stdout, str(run)
    best = trials[0]
    best_yaml = yaml.safe_load((sweep_dir / "best.yaml").read_text())
    assert "trainer.callbacks+" not in best_yaml, best_yaml  # the sweep's pruning callback stays out
    assert best_yaml["trainer.max_epochs"] == FAST["trainer.max_epochs"]

    # best.yaml as the README says: `make train ARGS="--config runs/sweeps/t/best.yaml"` reproduces the best trial's
    # metric bit for bit (same seed, same thread count, deterministic CPU kernels). The fit that command makes runs
    # in this process (one thread, as the trials had), and then --report, which rewrites the results from the
    # study alone.
    import project.sweep

    (sweep_dir / "best.yaml").rename(tmp_path / "best.yaml")
    (sweep_dir / "report.png").unlink()
    with monkeypatch.context() as mp:
        mp.chdir(checkout)
        assert run_cli("fit", "--config", "configs/default.yaml", "--config", tmp_path / "best.yaml") == 0
        with pytest.raises(SystemExit) as report:
            project.sweep.main(["--report", "--space", str(space), "--dir", "runs/sweeps/t"])
    assert not report.value.code  # exit 0
    (run_dir,) = [p for p in (checkout / "runs").iterdir() if p.name != "sweeps"]
    assert summary(run_dir)["best_score"] == best.value, (summary(run_dir), best.value)
    assert (sweep_dir / "best.yaml").read_text() == (tmp_path / "best.yaml").read_text()
    assert (sweep_dir / "best.yaml").is_file() and (sweep_dir / "report.png").is_file()


def processes_in(sweep_dir: Path) -> list[int]:
    """Live processes whose command line names the sweep directory (workers and their trials)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(sweep_dir) in (proc / "cmdline").read_bytes().decode(
                errors="replace"
            ):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


@pytest.mark.timeout(2 * SWEEP_TIMEOUT)
@pytest.mark.claim("sweep-resume", "sweep-workers")
def test_killed_sweep_resumes_with_the_same_command(tmp_path):
    """Two workers (`--workers 2`) run two distinct trials at once. Then worker 1 is killed with kill -9 (its
    trial is left RUNNING: a dead worker) and the sweep process too (worker 0 then stops its trial and queues its
    values again). The same command again: the dead worker's trial is marked failed and re-queued, and each killed
    trial's values run once more, to exactly n_trials complete trials. The trials are stubs that run until the test
    lets them end (tests/stub_trials/sitecustomize.py): the first launch's trials are killed while running."""
    space = write_space(
        tmp_path / "t.yaml",
        n_trials=2,
        pruner={"class_path": "optuna.pruners.NopPruner"},
        fixed={**FAST, "trainer.max_epochs": 1},
        params={SMOOTHING: {"type": "float", "low": 0.0, "high": 0.2}},
    )
    checkout = user_checkout(tmp_path / "clone")
    sweep_dir = (tmp_path / "sweep").resolve()
    command = [sys.executable, "-m", "project", "sweep", "--space", str(space), "--dir", str(sweep_dir)]
    hold = tmp_path / "hold"  # the trials run while it exists
    hold.touch()
    stubs = {**THREADS, **stub_environment(hold)}
    env = {**user_environment(), **stubs}
    first = subprocess.Popen([*command, "--workers", "2"], cwd=checkout, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + SWEEP_TIMEOUT
        running = []
        while time.monotonic() < deadline and first.poll() is None:
            if (sweep_dir / "study.db").exists():
                try:
                    running = study_of(sweep_dir).get_trials(states=(TrialState.RUNNING,))
                except (KeyError, optuna.exceptions.StorageInternalError, sqlalchemy.exc.SQLAlchemyError):
                    running = []  # the study is being created (its tables too: "table ... already exists")
                # mid-trial: both trial processes are running (they wrote their config.yaml)
                if len(running) == 2 and all(
                    (Path(t.user_attrs.get("run_dir", "-")) / "config.yaml").exists() for t in running
                ):
                    break
            time.sleep(0.5)
        assert len(running) == 2, f"two trials never ran at once (sweep exit code {first.poll()})"
        assert len({t.user_attrs["pid"] for t in running}) == 2  # two workers
        assert len({t.params[SMOOTHING] for t in running}) == 2  # each worker draws its own values
        killed = {t.number: t.params for t in running}
        os.kill(running[1].user_attrs["pid"], signal.SIGKILL)  # a dead worker
        first.send_signal(signal.SIGKILL)  # the sweep process
        first.wait(timeout=60)
        # every worker and trial process of the sweep ends (trials get SIGTERM when their worker dies)
        deadline = time.monotonic() + 120
        while processes_in(sweep_dir) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not processes_in(sweep_dir), "processes of the killed sweep kept running"
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
        for pid in processes_in(sweep_dir):
            os.kill(pid, signal.SIGKILL)

    hold.unlink()
    again = launch([*command, "--workers", "2"], checkout, env=stubs, timeout=SWEEP_TIMEOUT)
    assert again.returncode == 0, str(again)
    trials = study_of(sweep_dir).get_trials()
    by_state = {s: [t for t in trials if t.state == s] for s in TrialState}
    assert len(by_state[TrialState.COMPLETE]) == 2, str(again)
    assert {t.number for t in by_state[TrialState.FAIL]} == set(killed), str(again)
    assert not by_state[TrialState.RUNNING] and not by_state[TrialState.WAITING], str(again)
    # none lost, none run twice: the complete trials are the killed trials' values, once each
    complete = sorted(t.params[SMOOTHING] for t in by_state[TrialState.COMPLETE])
    assert complete == sorted(p[SMOOTHING] for p in killed.values()), (complete, killed)
    dirs = sorted(p.name for p in (sweep_dir / "trials").iterdir())
    assert dirs == [f"{t.number:03d}" for t in trials], dirs


@pytest.mark.timeout(2 * SWEEP_TIMEOUT)
@pytest.mark.claim("sweep-many-machines")
def test_slurm_array_worker_with_a_journal_storage(tmp_path):
    """scripts/sweep_slurm.sbatch as an array task runs it (no sbatch needed: the script is bash): without
    --storage it refuses; with a journal file it runs a worker whose trial process reports its epochs there. The
    input check is a stub, the trial a real run."""
    checkout = user_checkout(tmp_path / "clone")
    space = write_space(
        tmp_path / "t.yaml",
        n_trials=1,
        fixed={**FAST, "trainer.max_epochs": 1},
        params={SMOOTHING: {"type": "float", "low": 0.0, "high": 0.2}},
    )
    script = ["bash", "scripts/sweep_slurm.sbatch", "--space", str(space), "--dir", "runs/sweeps/t"]
    # PY: the environment's python, as a job script gets it from an activated environment
    env = {**THREADS, "SLURM_ARRAY_TASK_ID": "3", "SLURM_SUBMIT_DIR": str(checkout), "PY": sys.executable}
    # The stub check's val/loss, minimize, no base trial: what the real check finds for this space.
    env |= stub_environment(None)
    refused = launch(script, checkout, env=env, timeout=60)
    assert refused.returncode == 2 and "--storage" in refused.stderr, str(refused)
    journal = tmp_path / "shared" / "study.journal"
    journal.parent.mkdir()
    run = launch([*script, "--storage", f"journal:{journal}"], checkout, env=env, timeout=SWEEP_TIMEOUT)
    assert run.returncode == 0, str(run)
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal)))
    (trial,) = optuna.load_study(study_name="t", storage=storage).get_trials()
    assert trial.state == TrialState.COMPLETE, str(run)
    assert trial.intermediate_values == {0: trial.value}, (
        trial.intermediate_values
    )  # reported by the trial process
    assert (checkout / "runs" / "sweeps" / "t" / "best.yaml").is_file()

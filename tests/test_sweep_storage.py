"""project/sweep/storage.py and the worker's bookkeeping of trials (project/sweep/worker.py), without trial processes.

Storages that cannot be opened, workers that start in the same instant, the base config's trial and dead workers'
trials: each test drives the sweep's own functions (or `python -m project sweep` with the trial runner replaced
by a stub), in seconds. The 3-worker test uses SQLite (the default storage and an `sqlite+pysqlite://` URL, which
takes the path of any database server's URL) and the journal file; PostgreSQL needs a server and a driver that
are not in the test environment.
"""

import importlib.util
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

import project
from project.errors import ConfigError
from project.sweep.storage import default_storage, open_storage
from project.sweep.worker import Sweep
from tests.stub_trials.sitecustomize import stub_environment

LR = "model.init_args.optimizer.init_args.lr"
ROOT = Path(project.__file__).resolve().parent.parent  # the checkout under test (children import it too)
# The worker's storage has Optuna's heartbeat, which warns outside Study.optimize (the tests take trials by hand).
pytestmark = pytest.mark.filterwarnings(
    "ignore:Heartbeat of storage is supposed to be used with Study.optimize"
)
START_TIMEOUT = 240  # seconds for three worker processes to start and join on 2 shared cores


def write_space(path: Path, **overrides) -> Path:
    space = {
        "name": "t",
        "n_trials": 3,
        "sampler": {"class_path": "optuna.samplers.RandomSampler", "init_args": {"seed": 0}},
        "params": {LR: {"type": "float", "low": 1.0e-4, "high": 1.0e-2, "log": True}},
        **overrides,
    }
    path.write_text(yaml.safe_dump(space, sort_keys=False))
    return path


@pytest.mark.parametrize(
    "url, expected",
    [
        ("runs/sweeps/study.db", "Could not parse SQLAlchemy URL"),  # a path without sqlite:///
        ("postgres://user:secret@db-host/optuna", "Can't load plugin"),  # SQLAlchemy spells it postgresql
        ("sqlite:///{tmp}/missing/dir/study.db", "unable to open database file"),  # SQLite's words
        ("sqlite:///{tmp}/file/study.db", "unable to open database file"),
        ("sqlite:///{tmp}", "unable to open database file"),  # a folder, not a database file
        ("journal:{tmp}/missing/study.journal", "No such file or directory"),
        ("journal:{tmp}/file/study.journal", "Not a directory"),
        (
            "postgresql://user:secret@db-host/optuna",
            "pip install 'psycopg[binary]'",
        ),  # SQLAlchemy 2.1: psycopg 3
        ("postgresql+psycopg2://user:secret@db-host/optuna", "pip install psycopg2-binary"),
    ],
)
@pytest.mark.claim("sweep-many-machines")
def test_storage_that_cannot_be_opened_is_one_paragraph(tmp_path, url, expected):
    url, expected = url.format(tmp=tmp_path), expected.format(tmp=tmp_path)
    driver = {"postgresql": "psycopg", "postgresql+psycopg2": "psycopg2"}.get(url.split("://")[0])
    if driver and importlib.util.find_spec(driver):
        pytest.skip(f"{driver} is installed here: the missing-driver message cannot show")
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(ConfigError) as err:
        open_storage(url)
    message = str(err.value)
    assert expected in message and "\n" not in message, message
    assert "secret" not in message, message  # the password stays out of logs
    assert not (tmp_path / "missing").exists()  # no folder made for a mistyped path


@pytest.mark.claim("sweep-many-machines")
def test_storage_error_exits_2_with_one_paragraph(tmp_path, capsys):
    """`python -m project sweep --storage <a folder that does not exist>`: exit code 2, one `error:` paragraph, and
    no folder made (a lock file beside the database created the missing folders)."""
    import project.sweep

    url = f"sqlite:///{tmp_path}/missing/dir/study.db"
    space = write_space(tmp_path / "t.yaml")
    # --child (as a worker of --workers N): the input check's dry run is not this test's subject
    with pytest.raises(SystemExit) as exit_:
        project.sweep.main(
            ["--space", str(space), "--dir", str(tmp_path / "sweep"), "--storage", url, "--child"]
        )
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2, err
    assert err.startswith("error: ") and "\n" not in err and "unable to open database file" in err, err
    assert not (tmp_path / "missing").exists()


def test_unreachable_server_is_one_paragraph(monkeypatch):
    """A server that refuses the connection: what the driver said, and what to check (no server is needed: the
    driver's error is raised where RDBStorage connects)."""
    from optuna.storages import RDBStorage

    def refused(self, url, **kwargs):
        raise sqlalchemy.exc.OperationalError(
            "SELECT 1", {}, ConnectionRefusedError("port 5432 failed: refused")
        )

    monkeypatch.setattr(RDBStorage, "__init__", refused)
    with pytest.raises(ConfigError) as err:
        open_storage("postgresql+psycopg://user:secret@db-host/optuna")
    message = str(err.value)
    assert "port 5432 failed: refused" in message and "database server runs" in message, message
    assert "secret" not in message and "\n" not in message, message


@pytest.mark.claim("sweep-workers", "sweep-many-machines")
def test_schema_created_by_another_worker_meanwhile_is_loaded(tmp_path, monkeypatch):
    """The interleaving of workers started together, forced: another worker creates the tables between this
    worker's check for them and its CREATE TABLE (SQLite: "table ... already exists"; PostgreSQL: a duplicate
    `CREATE TYPE studydirection`). The worker loads the schema that is there and joins."""
    from optuna.storages._rdb import models

    url = default_storage(tmp_path)
    metadata = models.BaseModel.metadata
    create_all = type(metadata).create_all
    collided = []

    def racing_create_all(bind, tables=None, checkfirst=True):
        if not collided:
            collided.append(True)
            create_all(metadata, sqlalchemy.create_engine(url))  # the other worker, first
            return create_all(metadata, bind, tables, checkfirst=False)  # this one, after finding no tables
        return create_all(metadata, bind, tables, checkfirst)

    monkeypatch.setattr(metadata, "create_all", racing_create_all)
    storage = open_storage(url)
    assert collided
    optuna.create_study(study_name="t", storage=storage)
    assert [s.study_name for s in optuna.get_all_study_summaries(storage)] == ["t"]


JOIN = """
import sys, time
from pathlib import Path

import optuna, sqlalchemy  # the imports before the barrier: the workers then differ by a millisecond, not seconds
import project.sweep, project.sweep.report, project.sweep.storage, project.sweep.worker


def join(sweep, study):  # instead of running trials: take one and draw its values, as a worker's first step does
    trial = study.ask()
    sweep.space.sample(trial)
    print(f"joined trial {trial.number}", flush=True)
    return 0


project.sweep.worker.run_worker = join
Path(sys.argv[1]).touch()
while not Path(sys.argv[2]).exists():
    time.sleep(0.001)
project.sweep.main(sys.argv[3:])
"""


def stubbed(tmp_path: Path, checked) -> dict[str, str]:
    """The environment of sweep processes whose input check returns `checked` and whose trials write their
    summary.json at once (tests/stub_trials/sitecustomize.py)."""
    env = {**os.environ, **stub_environment(tmp_path / "no-hold", checked), "OMP_NUM_THREADS": "1"}
    return env | {"PYTHONPATH": os.pathsep.join([str(ROOT), env["PYTHONPATH"]])}


CHECKED: dict[str, list] = {}


def checked_inputs(space: Path) -> list:
    """What the sweep's input check returns for `space` and configs/default.yaml, its dry run left out (not the
    subject here): the metric, its direction and the base config's values. Once per sweep file text (each check
    parses the training config several times)."""
    import project.sweep.check
    from project.sweep.space import load_space

    text = space.read_text()
    if text not in CHECKED:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(project.sweep.check, "reported_metrics", lambda *args: ["val/loss"])
            configs = [str(ROOT / "configs/default.yaml")]
            CHECKED[text] = list(project.sweep.check.check_inputs(space, load_space(space), configs))
    return CHECKED[text]


@pytest.mark.slow
@pytest.mark.timeout(2 * START_TIMEOUT)
@pytest.mark.claim("sweep-workers", "sweep-many-machines")
@pytest.mark.parametrize("storage", ["default", "sqlite+pysqlite", "journal"])
def test_three_workers_started_at_once_all_join(tmp_path, storage):
    """Three `python -m project sweep` processes started in the same millisecond on a new study (an array job's
    tasks): each creates or loads the study and takes a trial; none fails creating the schema, and the base
    config's trial is queued once (each worker that found no trials queued it: it ran twice)."""
    sweep_dir = tmp_path / "sweep"
    urls = {
        "default": None,
        "sqlite+pysqlite": f"sqlite+pysqlite:///{tmp_path / 'study.db'}",
        "journal": f"journal:{tmp_path / 'study.journal'}",
    }
    space = write_space(tmp_path / "t.yaml")
    argv = ["--space", str(space), "--dir", str(sweep_dir)]
    if urls[storage]:
        argv += ["--storage", urls[storage]]
    script = tmp_path / "join.py"
    script.write_text(JOIN)
    go = tmp_path / "go"
    # The input check's result, found here (Lightning is not imported there: the workers start in a second).
    env = stubbed(tmp_path, checked_inputs(space))
    workers = [
        subprocess.Popen(
            [
                sys.executable,
                str(script),
                str(tmp_path / f"ready{k}"),
                str(go),
                *argv,
                "--worker_index",
                str(k),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for k in range(3)
    ]
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not all((tmp_path / f"ready{k}").exists() for k in range(3)):
            assert time.monotonic() < deadline, "the workers never reached the barrier"
            assert all(w.poll() is None for w in workers), [w.communicate() for w in workers]
            time.sleep(0.05)
        go.touch()  # the barrier: all three start now
        outputs = [w.communicate(timeout=START_TIMEOUT) for w in workers]
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
    report = "\n".join(
        f"worker {k} exit {w.returncode}:\n{o}\n{e}" for k, (w, (o, e)) in enumerate(zip(workers, outputs))
    )
    assert all(w.returncode == 0 for w in workers), report
    joined = sorted(int(o.split("joined trial ")[1].split()[0]) for o, _ in outputs)
    assert joined == [0, 1, 2], report
    url = urls[storage] or default_storage(sweep_dir)
    trials = optuna.load_study(study_name="t", storage=open_storage(url)).get_trials()
    assert len(trials) == 3, [(t.number, t.state, t.user_attrs) for t in trials]
    base = [t for t in trials if t.user_attrs.get("base_config")]
    assert len(base) == 1 and base[0].params == {LR: 0.003}, [
        (t.number, t.params, t.user_attrs) for t in trials
    ]


@pytest.fixture
def short_grace(monkeypatch):
    """A heartbeat every second, stale after one: a dead worker's trial is found in seconds, not the default 20."""
    import project.sweep.storage

    monkeypatch.setattr(project.sweep.storage, "HEARTBEAT_INTERVAL_S", 1)
    monkeypatch.setattr(project.sweep.storage, "GRACE_PERIOD_S", 1)
    return 2.1  # seconds after which it is stale for certain (SQLite keeps whole seconds)


def run_by_dead_worker(study: optuna.Study) -> optuna.trial.FrozenTrial:
    """study.ask() as a worker does, and one heartbeat, then nothing: its worker was killed."""
    trial = study.ask()
    trial.suggest_float(LR, 1.0e-4, 1.0e-2, log=True)  # the sweep's space.sample: a queued value as it is
    study._storage.record_heartbeat(trial._trial_id)
    return study.get_trials(deepcopy=False)[trial.number]


def new_study(tmp_path: Path) -> optuna.Study:
    return optuna.create_study(study_name="t", storage=open_storage(default_storage(tmp_path)))


@pytest.mark.claim("sweep-resume")
def test_base_config_trial_is_requeued_past_the_retry_limit(tmp_path, short_grace):
    """The base config's trial killed with its worker again and again (kill -9, a lost node, a SIGTERM) is queued
    again every time, past the retry limit of other trials: the best trial is never worse than the default."""
    from project.sweep.storage import MAX_RETRY

    study = new_study(tmp_path)
    study.enqueue_trial({LR: 0.003}, user_attrs={"base_config": True})
    killed = run_by_dead_worker(study)
    assert killed.params == {LR: 0.003} and killed.user_attrs["base_config"], killed
    time.sleep(short_grace)
    optuna.storages.fail_stale_trials(study)  # as every worker does before its next trial
    assert study.get_trials()[killed.number].state == TrialState.FAIL
    # again and again: the storage's callback, as fail_stale_trials calls it, queues it every time
    callback = study._storage.get_heartbeat_stale_trial_callback()
    for _ in range(MAX_RETRY + 2):
        trial = study.ask()
        assert trial.suggest_float(LR, 1.0e-4, 1.0e-2, log=True) == 0.003
        study.tell(trial, state=TrialState.FAIL)
        callback(study, study.get_trials()[trial.number])
    waiting = study.get_trials(states=(TrialState.WAITING,))
    assert len(waiting) == 1 and waiting[0].user_attrs["base_config"], waiting

    # a SIGTERM / Ctrl-C of the worker during the trial re-queues it as the base config's trial still
    sweep = make_sweep(tmp_path)
    trial = study.ask()

    class Interrupted:
        def __init__(self, *args, **kwargs):
            self.returncode = 143

        def wait(
            self, timeout=None
        ):  # the worker's wait is interrupted; stop_process's finds the trial ended
            if timeout is None:
                raise KeyboardInterrupt
            return 143

        def terminate(self):
            pass

        kill = terminate

    from project.sweep import worker

    worker.subprocess.Popen, popen = Interrupted, worker.subprocess.Popen
    try:
        with pytest.raises(KeyboardInterrupt):
            sweep.objective(trial)
    finally:
        worker.subprocess.Popen = popen
    (retry,) = study.get_trials(states=(TrialState.WAITING,))
    assert retry.user_attrs.get("base_config") and retry.system_attrs["retry_history"][-1] == trial.number, (
        retry
    )


def make_sweep(tmp_path: Path) -> Sweep:
    from project.sweep.space import load_space

    space = load_space(write_space(tmp_path / "t.yaml"))
    configs = [str(ROOT / "configs" / "default.yaml")]
    return Sweep(space, tmp_path, default_storage(tmp_path), configs, "val/loss", 3, 3)


def test_the_stop_at_max_failed_counts_this_commands_failures(tmp_path, capsys):
    """--max_failed 1 on a study with 2 failed trials from an earlier command and 1 from this one: the worker stops
    and says 1 failed against --max_failed 1."""
    from dataclasses import replace

    from optuna.distributions import FloatDistribution
    from optuna.trial import create_trial

    from project.sweep.worker import run_worker

    study = new_study(tmp_path)
    for _ in range(3):
        study.add_trial(
            create_trial(
                state=TrialState.FAIL,
                params={"lr": 1e-3},
                distributions={"lr": FloatDistribution(1e-4, 1e-2)},
                user_attrs={"error": "exit code 2"},
            )
        )
    sweep = replace(make_sweep(tmp_path), max_failed=1, first_trial=2)
    assert run_worker(sweep, study) == 1
    err = capsys.readouterr().err
    assert "error: 1 trials of this command failed (--max_failed 1); the sweep stops" in err, err


def _take_a_trial(url: str, barrier, taken) -> None:
    study = optuna.load_study(study_name="s", storage=open_storage(url))
    barrier.wait()  # both workers ask within a millisecond of each other
    taken.put(study.ask().number)


@pytest.mark.claim("sweep-workers")
def test_a_queued_trial_goes_to_one_of_two_workers_asking_at_once(tmp_path):
    """Optuna hands a queued trial to one worker by reading and updating it in one transaction with SELECT ... FOR
    UPDATE, which SQLite ignores; with Python's sqlite3 starting the transaction only at the update, two workers
    took the same trial (ran it in the same directory, and the second failed with "Cannot tell a COMPLETE trial").
    Without project.sweep.storage.serialize_sqlite_transactions 16 of 30 such rounds did: all 12 rounds here pass
    with that bug with a chance of (14/30)^12, about 1e-4."""
    import multiprocessing

    context = multiprocessing.get_context("fork")  # the child only opens the storage and asks
    for round_ in range(12):
        url = f"sqlite:///{tmp_path / f'study{round_}.db'}"
        optuna.create_study(study_name="s", storage=open_storage(url)).enqueue_trial({"x": 1.0})
        barrier, taken = context.Barrier(2), context.Queue()
        workers = [context.Process(target=_take_a_trial, args=(url, barrier, taken)) for _ in range(2)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=60)
        assert all(worker.exitcode == 0 for worker in workers)
        numbers = sorted(taken.get(timeout=5) for _ in workers)
        assert numbers == [0, 1], f"round {round_}: both workers took trial {numbers[0]}"


def _recover(tmp_path: Path, barrier) -> None:
    study = optuna.load_study(study_name="t", storage=open_storage(default_storage(tmp_path)))
    barrier.wait()  # both workers look for dead workers' trials within a millisecond of each other
    optuna.storages.fail_stale_trials(study)


@pytest.mark.claim("sweep-resume", "sweep-workers")
def test_a_dead_workers_trial_is_queued_again_once_when_two_workers_recover_it_at_once(tmp_path, short_grace):
    """Two workers resuming together both find the dead worker's trial stale; only one of them fails it and queues
    its values again (on SQLite both did, when a transaction began only at its first write: the extra copy then
    waited forever once n_trials were finished)."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    dead = {}
    for round_ in range(10):
        (tmp_path / str(round_)).mkdir()
        dead[round_] = run_by_dead_worker(new_study(tmp_path / str(round_)))
    time.sleep(short_grace)
    for round_, trial in dead.items():
        barrier = context.Barrier(2)
        workers = [context.Process(target=_recover, args=(tmp_path / str(round_), barrier)) for _ in range(2)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=60)
        assert all(worker.exitcode == 0 for worker in workers)
        storage = open_storage(default_storage(tmp_path / str(round_)))
        trials = optuna.load_study(study_name="t", storage=storage).get_trials()
        assert trials[trial.number].state == TrialState.FAIL
        waiting = [t for t in trials if t.state == TrialState.WAITING]
        assert len(waiting) == 1 and waiting[0].params == trial.params, (
            f"round {round_}: {len(waiting)} copies"
        )


KILLED_IN_ASK = """
import os, signal, sys

import optuna
import project.sweep

# The input check and the trials are stubs (tests/stub_trials/sitecustomize.py, on PYTHONPATH).
if sys.argv[1] == "kill":  # inside ask(): the queued trial has just become RUNNING, and its worker dies
    for storage in (optuna.storages.RDBStorage, optuna.storages.JournalStorage):

        def set_state(self, trial_id, state, values=None, _set=storage.set_trial_state_values):
            done = _set(self, trial_id, state, values)
            if state == optuna.trial.TrialState.RUNNING:
                os.kill(os.getpid(), signal.SIGKILL)
            return done

        storage.set_trial_state_values = set_state
project.sweep.main(sys.argv[2:])
"""


@pytest.mark.claim("sweep-resume")
@pytest.mark.parametrize("storage", ["default", "journal"])
def test_a_worker_killed_inside_ask_leaves_no_trial_running(tmp_path, storage):
    """A worker SIGKILLed inside Optuna's ask(), when the queued base config's trial has become RUNNING and before
    its first heartbeat (forced by a hook in the storage, not timed). The same command again fails that trial, queues
    its values again and completes exactly n_trials, none left RUNNING, on SQLite and on the journal (before, the
    trial had no heartbeat: SQLite's re-run waited for it for ever, the journal's ended one trial short)."""
    script = tmp_path / "sweep.py"
    script.write_text(KILLED_IN_ASK)
    argv = ["--space", str(write_space(tmp_path / "t.yaml", n_trials=2)), "--dir", str(tmp_path / "sweep")]
    url = (
        f"journal:{tmp_path / 'study.journal'}"
        if storage == "journal"
        else default_storage(tmp_path / "sweep")
    )
    argv += ["--storage", url] if storage == "journal" else []
    env = stubbed(tmp_path, ("val/loss", "minimize", {LR: 0.003}))  # the first trial is the base config's

    def sweep(mode: str) -> subprocess.CompletedProcess:
        command = [sys.executable, str(script), mode, *argv]
        return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)

    killed = sweep("kill")
    assert killed.returncode == -signal.SIGKILL, killed
    study = optuna.load_study(study_name="t", storage=open_storage(url))
    (trial,) = study.get_trials()
    assert trial.state == TrialState.RUNNING and trial.user_attrs["base_config"], trial  # killed inside ask()
    again = sweep("rerun")
    assert again.returncode == 0, again
    trials = optuna.load_study(study_name="t", storage=open_storage(url)).get_trials()
    states = [t.state for t in trials]
    assert states.count(TrialState.COMPLETE) == 2 and TrialState.RUNNING not in states, [
        (t.number, t.state, t.params) for t in trials
    ]
    assert trials[0].state == TrialState.FAIL and TrialState.WAITING not in states, states
    assert {LR: 0.003} in [t.params for t in trials if t.state == TrialState.COMPLETE]  # its values ran

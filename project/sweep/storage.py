"""Where a study lives, and what becomes of a dead worker's trial.

| storage | URL | for | dead worker's trial | pruning of DDP trials |
| SQLite | sqlite:///<sweep>/study.db (default) | one machine, any number of workers | re-queued | yes |
| RDB | postgresql://user@host/db (psycopg 3), mysql+pymysql://... | many machines | re-queued (heartbeat) | yes |
| journal | journal:<path on a shared filesystem> | many machines without a database | same machine only | no |

A dead worker's trial is failed and its parameters queued again by Optuna: the storage's heartbeat (SQLite is an
RDB storage too) lets Study.optimize fail stale trials, and RetryHeartbeatStaleTrialCallback re-queues them. On
this machine a worker's death is seen at once, by its process id (`recover_dead_trials`). The journal has no
heartbeat, and optuna-integration prunes DDP trials only on an RDB storage. A storage that cannot be opened is a
ConfigError: one paragraph and exit code 2, not a traceback.
"""

import copy
import os
import random
import socket
import time
import warnings
from pathlib import Path

import optuna
from optuna.trial import TrialState

from project.errors import ConfigError, find_in_chain

HEARTBEAT_INTERVAL_S, GRACE_PERIOD_S = 10, 60
MAX_RETRY = 3  # a trial that takes its worker down every time is not retried forever (the base config's is)
JOURNAL = "journal:"
# The Python module SQLAlchemy imports for a URL's driver -> what to pip install (SQLAlchemy 2.1's `postgresql://`
# is psycopg 3).
DRIVERS = {
    "psycopg": "'psycopg[binary]'",
    "psycopg2": "psycopg2-binary",
    "pymysql": "pymysql",
    "MySQLdb": "mysqlclient",
}


def default_storage(sweep_dir: Path) -> str:
    return f"sqlite:///{Path(sweep_dir).resolve() / 'study.db'}"


def open_storage(url: str, heartbeat: bool = True):
    """The Optuna storage for a URL. `heartbeat`: the worker's (a trial process only reports and reads)."""
    # Heartbeats and the retry callback are experimental in Optuna 5; they are what resumes dead workers.
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # quiet schema messages; the worker turns INFO on
    try:
        if url.startswith(JOURNAL):
            from optuna.storages.journal import JournalFileBackend, JournalStorage

            check_folder(url[len(JOURNAL) :], url)
            return JournalStorage(JournalFileBackend(url[len(JOURNAL) :]))
        return open_rdb(url, heartbeat)
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(cannot_open(url, err)) from err


def open_rdb(url: str, heartbeat: bool):
    import sqlalchemy
    from optuna.storages import RDBStorage

    parsed = sqlalchemy.engine.make_url(url)  # a malformed URL fails here, before any connection
    sqlite = parsed.get_backend_name() == "sqlite"
    kwargs = {}
    if heartbeat:
        kwargs = dict(
            heartbeat_interval=HEARTBEAT_INTERVAL_S,
            grace_period=GRACE_PERIOD_S,
            heartbeat_stale_trial_callback=requeue_dead_trial,
        )
    if sqlite:
        if parsed.database and parsed.database != ":memory:" and not parsed.database.startswith("file:"):
            check_folder(parsed.database, url)  # SQLite would say only "unable to open database file"
        # Several workers write one file: wait for SQLite's lock instead of failing after its default 5 s.
        kwargs["engine_kwargs"] = {"connect_args": {"timeout": 120}}
    # RDBStorage creates the tables it does not find. Workers started together all did, and all but one failed
    # (SQLite: "table studies already exists"; PostgreSQL: a duplicate `CREATE TYPE studydirection`): the schema
    # another worker created meanwhile is loaded on the next attempt.
    for attempt in range(1, 11):
        try:
            storage = RDBStorage(url, **kwargs)
        except Exception as err:
            raced = find_in_chain(err, sqlalchemy.exc.DBAPIError)
            if attempt == 10 or not (
                isinstance(raced, sqlalchemy.exc.IntegrityError) or "already exists" in str(raced).lower()
            ):
                raise
            time.sleep(random.uniform(0.05, 0.25) * attempt)
        else:
            if sqlite:
                serialize_sqlite_transactions(storage.engine)
            return storage


def serialize_sqlite_transactions(engine) -> None:
    """Every transaction on `engine` takes SQLite's write lock when it begins (BEGIN IMMEDIATE).

    Optuna hands a queued trial to one worker by reading and updating it in one transaction with SELECT ... FOR
    UPDATE. SQLite ignores FOR UPDATE, and Python's sqlite3 begins a transaction only at its first write, so two
    workers asking together both read the trial as WAITING and both ran it. With the lock taken at BEGIN, the
    second reads after the first one's commit; the same makes a dead worker's trial failed and re-queued once.
    SQLAlchemy's recipe for pysqlite ("Serializable isolation"); the connections opened while the schema was
    checked are dropped so that every later one follows it.
    """
    import sqlalchemy

    @sqlalchemy.event.listens_for(engine, "connect")
    def _no_implicit_begin(dbapi_connection, connection_record) -> None:
        dbapi_connection.isolation_level = None  # sqlite3 emits no BEGIN of its own; the listener below does

    @sqlalchemy.event.listens_for(engine, "begin")
    def _begin_immediate(connection) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    engine.dispose()


def check_folder(path: str, url: str) -> None:
    """The storage file's folder must exist: SQLite and the journal would fail with a bare OSError (and a typo in
    --storage must not make a new tree)."""
    folder = Path(path).expanduser().absolute().parent
    if not folder.is_dir():
        existing = next(p for p in (folder, *folder.parents) if p.exists())
        problem = (
            f"{existing} is a file, not a folder"
            if not existing.is_dir()
            else f"the folder {folder} does not exist"
        )
        raise ConfigError(
            f"Cannot open the study storage '{url}': {problem}. Create the folder (for many machines, on a "
            "filesystem they all reach) or pass another --storage."
        )


def cannot_open(url: str, err: BaseException) -> str:
    """One paragraph: which storage (password hidden), why it could not be opened, what to do."""
    import sqlalchemy

    shown = url
    if not url.startswith(JOURNAL):
        try:
            shown = sqlalchemy.engine.make_url(url).render_as_string(hide_password=True)
        except sqlalchemy.exc.ArgumentError:
            pass
    missing = find_in_chain(err, ModuleNotFoundError)
    module = (missing.name or "").split(".")[0] if missing else ""
    if module in DRIVERS:
        return (
            f"The study storage '{shown}' needs the database driver {module}, which is not installed: "
            f"pip install {DRIVERS[module]} (into this environment, on every machine of the sweep)."
        )
    cause = find_in_chain(err, sqlalchemy.exc.DBAPIError)
    lines = (
        str(cause.orig if cause is not None else err).strip().splitlines()
    )  # the driver's words, not the SQL
    reason = (lines[0] if lines else type(err).__name__).rstrip(".")
    if find_in_chain(err, sqlalchemy.exc.ArgumentError) is not None:
        fix = (
            "--storage takes sqlite:///<file>, postgresql://user:password@host/db (with psycopg 3), "
            "mysql+pymysql://user:password@host/db or journal:<file>."
        )
    elif url.startswith((JOURNAL, "sqlite")):
        fix = "It must be a file this user can write" + (
            ", on a filesystem every worker reaches." if url.startswith(JOURNAL) else "."
        )
    else:
        fix = (
            "Check that its database server runs and is reachable from this machine, and the URL's user, "
            "password, host, port and database name."
        )
    return f"Cannot open the study storage '{shown}': {reason}. {fix}"


def requeue_dead_trial(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
    """A dead worker's FAILED trial: its parameters queued again (RetryHeartbeatStaleTrialCallback), without the
    dead worker's host and pid, which would make the new trial look dead too. The base config's trial is retried
    without limit: the best trial must never be worse than the default."""
    from optuna.storages import RetryHeartbeatStaleTrialCallback

    retry = copy.deepcopy(trial)
    retry.user_attrs = {k: v for k, v in trial.user_attrs.items() if k not in ("host", "pid")}
    limit = None if trial.user_attrs.get("base_config") else MAX_RETRY
    RetryHeartbeatStaleTrialCallback(max_retry=limit)(study, retry)


def process_alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
        return Path(f"/proc/{int(pid)}/stat").read_text().split(")")[-1].split()[0] != "Z"  # a zombie is dead
    except ProcessLookupError:
        return False
    except (OSError, TypeError, ValueError):  # another user's process, or no /proc
        return True


def recover_dead_trials(study: optuna.Study) -> None:
    """RUNNING trials whose worker ran on this machine and is gone: failed, and their parameters re-queued.

    Once per trial also when several workers find it together: the first to fail it re-queues it, the others'
    `tell` finds it finished (on SQLite thanks to serialize_sqlite_transactions).
    """
    host = socket.gethostname()
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        pid = trial.user_attrs.get("pid")
        if trial.user_attrs.get("host") != host or pid is None or process_alive(pid):
            continue
        try:
            study.tell(trial.number, state=TrialState.FAIL)
        except (RuntimeError, ValueError):
            continue  # another worker got there first
        requeue_dead_trial(study, study.get_trials(deepcopy=True)[trial.number])
        print(
            f"Trial {trial.number}: its worker (pid {pid}) is gone; marked failed, values re-queued.",
            flush=True,
        )

"""Where a study lives: SQLite in the sweep directory (default), an RDB URL, or an Optuna journal file.

| storage | URL | for | dead worker's trial | pruning of DDP trials |
| SQLite | sqlite:///<sweep>/study.db (default) | one machine, any number of workers | re-queued | yes |
| RDB | postgresql://user@host/db (psycopg 3), mysql+pymysql://... | many machines | re-queued (heartbeat) | yes |
| journal | journal:<path on a shared filesystem> | many machines without a database | same machine only | no |

A dead worker's trial is marked FAIL and its parameters queued again by Optuna's RetryHeartbeatStaleTrialCallback
(the successor of RetryFailedTrialCallback, deprecated since Optuna 4.9). SQLite is an RDB storage too, so it has
Optuna's heartbeat; its file lock is not safe on network filesystems. Optuna's journal storage has no heartbeat,
and optuna-integration's pruning callback accepts only RDB storages under DDP.

A storage that cannot be opened (a malformed URL, a missing driver, a server that does not answer, a folder that
does not exist) is a ConfigError: one paragraph and exit code 2, not a traceback.
"""

import copy
import random
import time
import warnings
from pathlib import Path

from project.errors import ConfigError, find_in_chain

# A heartbeat every 10 s; a RUNNING trial whose heartbeat is 60 s old belongs to a dead worker (another machine's;
# on this machine a dead worker is seen at once by its process id, see project/sweep/worker.py).
HEARTBEAT_INTERVAL_S = 10
GRACE_PERIOD_S = 60
MAX_RETRY = 3  # a trial that takes its worker down every time is not retried forever (the base config's is)
JOURNAL_PREFIX = "journal:"
SCHEMA_ATTEMPTS = 10
# The worker that runs a trial (user attributes, project/sweep/worker.py): never copied to the trial's retry.
OWNER_ATTRS = ("host", "pid")
# The Python module SQLAlchemy imports for a URL's driver -> what to pip install. SQLAlchemy 2.1's `postgresql://`
# means psycopg 3 (psycopg2 needs `postgresql+psycopg2://`).
DRIVERS = {
    "psycopg": "'psycopg[binary]'",
    "psycopg2": "psycopg2-binary",
    "pymysql": "pymysql",
    "MySQLdb": "mysqlclient",
}
URL_FORMS = (
    "--storage takes sqlite:///<file>, postgresql://user:password@host/db (with psycopg 3), "
    "mysql+pymysql://user:password@host/db or journal:<file>."
)


def default_storage(sweep_dir: Path) -> str:
    return f"sqlite:///{Path(sweep_dir).resolve() / 'study.db'}"


def open_storage(url: str, heartbeat: bool = True):
    """The Optuna storage for a URL. `heartbeat`: the worker's (a trial process only reports and reads)."""
    import optuna

    # Heartbeats and the retry callback are marked experimental in Optuna 5; they are what resumes dead workers.
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # quiet schema messages; the worker turns INFO on
    try:
        if url.startswith(JOURNAL_PREFIX):
            return _open_journal(url[len(JOURNAL_PREFIX) :])
        return _open_rdb(url, heartbeat)
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(cannot_open(url, err)) from err


def _open_journal(path: str):
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    _check_folder(path, f"{JOURNAL_PREFIX}{path}")
    return JournalStorage(JournalFileBackend(path))


def _open_rdb(url: str, heartbeat: bool):
    import sqlalchemy
    from optuna.storages import RDBStorage

    parsed = sqlalchemy.engine.make_url(url)  # a malformed URL fails here, before any connection
    kwargs = {}
    sqlite = parsed.get_backend_name() == "sqlite"
    if sqlite:
        if parsed.database and parsed.database != ":memory:" and not parsed.database.startswith("file:"):
            _check_folder(parsed.database, url)  # SQLite would say only "unable to open database file"
        # Several workers write one file: wait for SQLite's lock instead of failing after its default 5 s.
        kwargs["engine_kwargs"] = {"connect_args": {"timeout": 120}}
    if heartbeat:
        kwargs.update(
            heartbeat_interval=HEARTBEAT_INTERVAL_S,
            grace_period=GRACE_PERIOD_S,
            heartbeat_stale_trial_callback=requeue_dead_trial,
        )
    # RDBStorage creates the schema when its tables are missing. Workers started together (an array job, `make
    # sweep WORKERS=3`, a reader) all did: PostgreSQL failed one with a duplicate `CREATE TYPE studydirection`,
    # SQLite with "table studies already exists". The schema another worker created meanwhile is loaded on the
    # next attempt (create_all skips existing tables); a lock file covered only SQLite, and no lock file reaches
    # a database server.
    for attempt in range(1, SCHEMA_ATTEMPTS + 1):
        try:
            storage = RDBStorage(url, **kwargs)
        except Exception as err:
            if attempt == SCHEMA_ATTEMPTS or not created_meanwhile(err):
                raise
            time.sleep(random.uniform(0.05, 0.25) * attempt)
        else:
            if sqlite:
                serialize_sqlite_transactions(storage.engine)
            return storage


def serialize_sqlite_transactions(engine) -> None:
    """Every transaction on `engine` takes SQLite's write lock when it begins (BEGIN IMMEDIATE).

    Optuna reads a trial and updates it in one transaction, with SELECT ... FOR UPDATE, to hand a queued trial to
    one worker only. SQLite ignores FOR UPDATE, and Python's sqlite3 module begins a transaction only at the first
    write, so two workers starting together both read the trial as WAITING and both took it: they ran the same
    trial in the same directory, and the second to finish failed with "Cannot tell a COMPLETE trial" (seen in CI
    after a killed sweep re-queued two trials). With the lock taken at BEGIN, the second worker reads after the
    first one's commit; the same makes a dead worker's trial failed and re-queued once (worker.recover_dead_trials). SQLAlchemy's recipe for pysqlite ("Serializable isolation"); the connections opened while
    the schema was checked are dropped so that every later one follows it.
    """
    import sqlalchemy

    @sqlalchemy.event.listens_for(engine, "connect")
    def _no_implicit_begin(dbapi_connection, connection_record) -> None:
        dbapi_connection.isolation_level = None  # sqlite3 emits no BEGIN of its own; the listener below does

    @sqlalchemy.event.listens_for(engine, "begin")
    def _begin_immediate(connection) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    engine.dispose()


def created_meanwhile(err: BaseException) -> bool:
    """Whether a schema creation failed because another process created the same table, type or row."""
    import sqlalchemy

    db_error = find_in_chain(err, sqlalchemy.exc.DBAPIError)
    return db_error is not None and (
        isinstance(db_error, sqlalchemy.exc.IntegrityError) or "already exists" in str(db_error).lower()
    )


def _check_folder(path: str, url: str) -> None:
    """The storage file's folder must exist: SQLite and the journal would fail with a bare OSError, and a file
    lock beside the database created missing folders silently (a typo in --storage made a new tree)."""
    folder = Path(path).expanduser().absolute().parent
    if folder.is_dir():
        return
    existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        problem = f"{existing} is a file, not a folder"
    else:
        problem = f"the folder {folder} does not exist"
    raise ConfigError(
        f"Cannot open the study storage '{url}': {problem}. Create the folder (for many machines, on a "
        "filesystem they all reach) or pass another --storage."
    )


def cannot_open(url: str, err: BaseException) -> str:
    """One paragraph: which storage, why it could not be opened, what to do."""
    import sqlalchemy

    shown = url
    if not url.startswith(JOURNAL_PREFIX):
        try:
            shown = sqlalchemy.engine.make_url(url).render_as_string(hide_password=True)
        except sqlalchemy.exc.ArgumentError:
            pass
    missing = find_in_chain(err, ModuleNotFoundError)
    if missing is not None and missing.name and missing.name.split(".")[0] in DRIVERS:
        module = missing.name.split(".")[0]
        return (
            f"The study storage '{shown}' needs the database driver {module}, which is not installed: "
            f"pip install {DRIVERS[module]} (into this environment, on every machine of the sweep)."
        )
    if find_in_chain(err, sqlalchemy.exc.ArgumentError) is not None:
        return f"Cannot open the study storage '{shown}': {_first_line(err)}. {URL_FORMS}"
    reason = _first_line(find_in_chain(err, sqlalchemy.exc.DBAPIError) or err)
    if url.startswith(JOURNAL_PREFIX):
        fix = "It must be a journal file this user can write, on a filesystem every worker reaches."
    elif url.startswith("sqlite"):
        fix = "It must be a SQLite file this user can write."
    else:
        fix = (
            "Check that its database server runs and is reachable from this machine, and the URL's user, "
            "password, host, port and database name."
        )
    return f"Cannot open the study storage '{shown}': {reason}. {fix}"


def _first_line(err: BaseException) -> str:
    import sqlalchemy

    if isinstance(err, sqlalchemy.exc.DBAPIError):
        err = err.orig  # the driver's own message, without SQLAlchemy's SQL and background link
    text = str(err).strip().splitlines()
    return (text[0] if text else type(err).__name__).rstrip(".")


def create_or_load(name: str, storage, direction: str):
    """The study, and whether this process created it. Creation is atomic in every storage (a unique name), so
    exactly one of several workers started together learns created=True; the base config's trial is queued by
    that one alone (each worker that found no trials queued it: the default config ran twice)."""
    import optuna

    try:
        return optuna.create_study(study_name=name, storage=storage, direction=direction), True
    except optuna.exceptions.DuplicatedStudyError:
        return optuna.load_study(study_name=name, storage=storage), False


def requeue_dead_trial(study, trial) -> None:
    """A FAILED trial of a dead worker: its parameters queued again (Optuna's RetryHeartbeatStaleTrialCallback),
    without the dead worker's host and pid, which another worker would read as the new trial's owner's and mark
    the live trial failed. The base config's trial is retried without limit: it must complete eventually, or the
    best trial could be worse than the default."""
    from optuna.storages import RetryHeartbeatStaleTrialCallback

    retry = copy.deepcopy(trial)
    retry.user_attrs = {k: v for k, v in trial.user_attrs.items() if k not in OWNER_ATTRS}
    limit = None if trial.user_attrs.get("base_config") else MAX_RETRY
    RetryHeartbeatStaleTrialCallback(max_retry=limit)(study, retry)


def supports_heartbeat(url: str) -> bool:
    return not url.startswith(JOURNAL_PREFIX)

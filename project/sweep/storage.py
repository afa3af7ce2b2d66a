"""Where a study lives: SQLite in the sweep directory (default), an RDB URL, or an Optuna journal file.

The RDB storages (SQLite among them) have Optuna's heartbeat: a RUNNING trial whose worker stopped beating for
GRACE_PERIOD_S is failed by fail_stale_trials, and requeue_dead_trial queues its values again; the journal has
none. A storage that cannot be opened is a ConfigError: one paragraph and exit code 2, not a traceback.
"""

import random
import re
import time
import warnings
from pathlib import Path

import optuna

from project.errors import ConfigError, find_in_chain

# A worker beats every 5 s while its trial runs; 4 missed beats make the trial a dead worker's.
HEARTBEAT_INTERVAL_S, GRACE_PERIOD_S = 5, 20
MAX_RETRY = 3  # a trial that takes its worker down every time is not retried forever (the base config's is)


def default_storage(sweep_dir: Path) -> str:
    return f"sqlite:///{Path(sweep_dir).resolve() / 'study.db'}"


def open_storage(url: str, heartbeat: bool = True):
    """The Optuna storage for a URL. `heartbeat`: the worker's (a trial process only reports and reads)."""
    import sqlalchemy
    from optuna.storages import JournalStorage, RDBStorage
    from optuna.storages.journal import JournalFileBackend

    # Heartbeats and the retry callback are experimental in Optuna 5; they are what resumes dead workers.
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # quiet schema messages; the worker turns INFO on
    # Several workers write one SQLite file: they wait for its lock, not 5 s (its default).
    kwargs = {"engine_kwargs": {"connect_args": {"timeout": 120}}} if url.startswith("sqlite") else {}
    if heartbeat:
        kwargs.update(heartbeat_interval=HEARTBEAT_INTERVAL_S, grace_period=GRACE_PERIOD_S)
        kwargs["heartbeat_stale_trial_callback"] = requeue_dead_trial
    # RDBStorage creates the tables it does not find. Workers started together all did, and all but one failed
    # (SQLite: "table studies already exists"; PostgreSQL: a duplicate `CREATE TYPE studydirection`): the schema
    # another worker created meanwhile is loaded on the next attempt.
    for attempt in range(1, 11):
        try:
            if url.startswith("journal:"):
                return JournalStorage(JournalFileBackend(url.removeprefix("journal:")))
            storage = RDBStorage(url, **kwargs)
            break
        except Exception as err:
            raced = find_in_chain(err, sqlalchemy.exc.DBAPIError)
            lost = isinstance(raced, sqlalchemy.exc.IntegrityError) or "already exists" in str(raced)
            if attempt == 10 or not lost:
                raise ConfigError(cannot_open(url, err)) from err
            time.sleep(random.uniform(0.05, 0.25) * attempt)
    if url.startswith("sqlite"):
        serialize_sqlite_transactions(storage.engine)
    return storage


def serialize_sqlite_transactions(engine) -> None:
    """Every transaction on `engine` takes SQLite's write lock when it begins (BEGIN IMMEDIATE): Optuna hands a
    queued trial to one worker with SELECT ... FOR UPDATE, which SQLite ignores, and Python's sqlite3 begins a
    transaction only at its first write, so two workers asking together both took the trial (and both re-queued
    one dead worker's trial). SQLAlchemy's recipe for pysqlite ("Serializable isolation")."""
    import sqlalchemy

    @sqlalchemy.event.listens_for(engine, "connect")
    def _no_implicit_begin(dbapi_connection, connection_record) -> None:
        dbapi_connection.isolation_level = None  # sqlite3 emits no BEGIN of its own; the listener below does

    @sqlalchemy.event.listens_for(engine, "begin")
    def _begin_immediate(connection) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    engine.dispose()  # the connections opened while the schema was checked, which lack the listeners


def cannot_open(url: str, err: BaseException) -> str:
    import sqlalchemy

    cause = find_in_chain(err, sqlalchemy.exc.DBAPIError)
    lines = str(cause.orig if cause else err).strip().splitlines()  # the driver's words, not SQLAlchemy's SQL
    shown = re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", url)  # no password in logs
    return (
        f"Cannot open the study storage '{shown}': "
        f"{(lines[0] if lines else type(err).__name__).rstrip('.')}. --storage takes sqlite:///<file> or "
        "journal:<file> (in an existing folder this user can write; for many machines, on a filesystem they all "
        "reach), postgresql://user:password@host/db (pip install 'psycopg[binary]'; postgresql+psycopg2:// with "
        "pip install psycopg2-binary) or mysql+pymysql://... (pip install pymysql), in this environment on every "
        "machine: check the URL, and that its database server runs and is reachable from here."
    )


def requeue_dead_trial(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
    """A dead worker's failed trial: its values queued again. The base config's trial is retried without limit:
    the best trial must never be worse than the default."""
    from optuna.storages import RetryHeartbeatStaleTrialCallback

    RetryHeartbeatStaleTrialCallback(None if trial.user_attrs.get("base_config") else MAX_RETRY)(study, trial)

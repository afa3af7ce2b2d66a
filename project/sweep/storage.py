"""Where a study lives: SQLite in the sweep directory (default), an RDB URL, or an Optuna journal file."""

import contextlib
import random
import re
import time
import warnings
from pathlib import Path

import optuna
from optuna.storages import JournalStorage, RDBStorage, RetryHeartbeatStaleTrialCallback
from optuna.storages._heartbeat import BaseHeartbeat
from optuna.trial import TrialState

from project.errors import ConfigError, find_in_chain

HEARTBEAT_INTERVAL_S, GRACE_PERIOD_S = 5, 20
MAX_RETRY = 3  # a trial that takes its worker down every time is not retried forever (the base config's is)


class Heartbeat(BaseHeartbeat):
    """Optuna's heartbeat, kept as a trial system attribute so that the journal has one too. A RUNNING trial counts
    from its start as well: its worker may have died inside ask(), before its first beat (a retry copies old beats)."""

    def record_heartbeat(self, trial_id: int) -> None:
        self.set_trial_system_attr(trial_id, "heartbeat", time.time())

    def _get_stale_trial_ids(self, study_id: int) -> list[int]:
        stale = []
        for t in self.get_all_trials(study_id, deepcopy=False, states=(TrialState.RUNNING,)):
            alive = max(t.system_attrs.get("heartbeat", 0), t.datetime_start.timestamp())
            if time.time() - alive > GRACE_PERIOD_S:
                stale.append(self.get_trial_id_from_study_id_trial_number(study_id, t.number))
        return stale

    def get_heartbeat_interval(self) -> int:
        return HEARTBEAT_INTERVAL_S

    def get_heartbeat_stale_trial_callback(self):
        return requeue_dead_trial


class RDB(Heartbeat, RDBStorage): ...


class Journal(Heartbeat, JournalStorage): ...


def requeue_dead_trial(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
    """A dead worker's trial, queued again; the base config's without limit (the best must never be worse)."""
    RetryHeartbeatStaleTrialCallback(None if trial.user_attrs.get("base_config") else MAX_RETRY)(study, trial)


def default_storage(sweep_dir: Path) -> str:
    return f"sqlite:///{Path(sweep_dir).resolve() / 'study.db'}"


def existing_study(url: str, name: str, sweep_dir: Path) -> optuna.Study | None:
    """The study if it exists, read without creating or writing anything."""
    if url != default_storage(sweep_dir) or Path(sweep_dir, "study.db").exists():
        with contextlib.suppress(KeyError):  # no such study
            return optuna.load_study(study_name=name, storage=open_storage(url))
    return None


def open_storage(url: str):
    """The storage for a URL, or a ConfigError paragraph when it cannot be opened."""
    import sqlalchemy
    from optuna.storages.journal import JournalFileBackend

    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)  # the retry callback
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # quiet schema messages; the worker turns INFO on
    # Several workers write one SQLite file: they wait for its lock, not 5 s (its default).
    kwargs = {"engine_kwargs": {"connect_args": {"timeout": 120}}} if url.startswith("sqlite") else {}
    # Workers started together all create the tables, and all but one fail ("table studies already exists",
    # PostgreSQL's duplicate `CREATE TYPE studydirection`): the next attempt loads what the other created.
    for attempt in range(1, 11):
        try:
            if url.startswith("journal:"):
                return Journal(JournalFileBackend(url.removeprefix("journal:")))
            storage = RDB(url, **kwargs)
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
    """Every transaction takes SQLite's write lock when it begins (SQLAlchemy's "Serializable isolation" recipe).
    Optuna hands a queued trial to one worker with SELECT ... FOR UPDATE, which SQLite ignores, and Python's
    sqlite3 begins a transaction only at its first write: two workers asking together both took the trial."""
    import sqlalchemy

    @sqlalchemy.event.listens_for(engine, "connect")
    def _no_implicit_begin(dbapi_connection, connection_record) -> None:
        dbapi_connection.isolation_level = None

    @sqlalchemy.event.listens_for(engine, "begin")
    def _begin_immediate(connection) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    engine.dispose()  # the connections opened while the schema was checked lack the listeners


def cannot_open(url: str, err: BaseException) -> str:
    import sqlalchemy

    cause = find_in_chain(err, sqlalchemy.exc.DBAPIError)
    lines = str(cause.orig if cause else err).strip().splitlines()  # the driver's words, not SQLAlchemy's SQL
    shown = re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", url)  # no password in logs
    return (
        f"Cannot open the study storage '{shown}': {(lines[0] if lines else type(err).__name__).rstrip('.')}. "
        "--storage takes sqlite:///<file> or journal:<file> (in a folder that exists; shared by every machine), "
        "postgresql://user:password@host/db (pip install 'psycopg[binary]'; postgresql+psycopg2:// with pip install "
        "psycopg2-binary) or mysql+pymysql://... (pip install pymysql): check it, and that its database server runs."
    )

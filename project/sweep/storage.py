"""Where a study lives: SQLite in the sweep directory (default), an RDB URL, or an Optuna journal file.

| storage | URL | for | dead worker's trial | pruning of DDP trials |
| SQLite | sqlite:///<sweep>/study.db (default) | one machine, any number of workers | re-queued | yes |
| RDB | postgresql://user@host/db, mysql+pymysql://... | many machines | re-queued (heartbeat) | yes |
| journal | journal:<path on a shared filesystem> | many machines without a database | same machine only | no |

A dead worker's trial is marked FAIL and its parameters queued again by Optuna's RetryHeartbeatStaleTrialCallback
(the successor of RetryFailedTrialCallback, deprecated since Optuna 4.9). SQLite is an RDB storage too, so it has Optuna's heartbeat; its file lock is not safe on network filesystems.
Optuna's journal storage has no heartbeat, and optuna-integration's pruning callback accepts only RDB storages
under DDP.
"""

import contextlib
import warnings
from pathlib import Path

from filelock import FileLock

# A heartbeat every 10 s; a RUNNING trial whose heartbeat is 60 s old belongs to a dead worker (another machine's;
# on this machine a dead worker is seen at once by its process id, see project/sweep/worker.py).
HEARTBEAT_INTERVAL_S = 10
GRACE_PERIOD_S = 60
MAX_RETRY = 3  # a trial that takes its worker down every time is not retried forever
JOURNAL_PREFIX = "journal:"


def default_storage(sweep_dir: Path) -> str:
    return f"sqlite:///{Path(sweep_dir).resolve() / 'study.db'}"


def open_storage(url: str, heartbeat: bool = True):
    """The Optuna storage for a URL. `heartbeat`: the worker's (a trial process only reports and reads)."""
    import optuna
    from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    # Heartbeats and the retry callback are marked experimental in Optuna 5; they are what resumes dead workers.
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    if url.startswith(JOURNAL_PREFIX):
        return JournalStorage(JournalFileBackend(url[len(JOURNAL_PREFIX) :]))
    kwargs = {}
    if url.startswith("sqlite"):
        # Several workers write one file: wait for SQLite's lock instead of failing after its default 5 s.
        kwargs["engine_kwargs"] = {"connect_args": {"timeout": 120}}
    if heartbeat:
        kwargs.update(
            heartbeat_interval=HEARTBEAT_INTERVAL_S,
            grace_period=GRACE_PERIOD_S,
            heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=MAX_RETRY),
        )
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # quiet schema messages; the worker turns INFO on
    # RDBStorage creates the schema when the tables are missing: two processes opening a new study.db at once (two
    # `make sweep` on one directory, or a reader) both did, and one failed with "table studies already exists".
    # One process at a time, under a lock file beside the database.
    sqlite = url.startswith("sqlite:///")
    with FileLock(url[len("sqlite:///") :] + ".lock") if sqlite else contextlib.nullcontext():
        return RDBStorage(url, **kwargs)


def supports_heartbeat(url: str) -> bool:
    return not url.startswith(JOURNAL_PREFIX)

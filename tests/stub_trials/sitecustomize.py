"""Python imports this module at start-up in every process whose PYTHONPATH holds this folder and whose environment
sets STUB_TRIALS_HOLD: tests whose subject is the sweep's bookkeeping (workers, kills, re-queued trials), not what a
trial trains, start real `python -m project sweep` processes with it (tests/test_sweep.py, test_sweep_storage.py).
There (workers included) the input check returns STUB_TRIALS_CHECK (JSON: metric, direction, the base config's
values), and a trial starts in a fraction of a second instead of importing Lightning: it writes its run directory's
config.yaml (it is running), waits while the file STUB_TRIALS_HOLD exists, then writes a summary.json and exits 0.
A worker's heartbeat comes every second, and a dead worker's trial is stale after 3 s instead of 20. With
STUB_TRIALS_CHECK alone (stub_environment(None)) only the input check is a stub: the trials are real runs.
"""

import json
import os
import sys

TRIAL = """
import json, os, sys, time
from pathlib import Path

run_dir, hold = Path(sys.argv[1]), Path(sys.argv[2])
(run_dir / "config.yaml").write_text("stub trial\\n")
while hold.exists():
    time.sleep(0.2)
(run_dir / "summary.json").write_text(json.dumps({"monitor": "val/loss", "best_score": 0.5}))
"""


def stub_environment(hold, checked=("val/loss", "minimize", {})) -> dict[str, str]:
    """The variables that turn the stubs on: trials run while the file `hold` exists (None: real trials); the
    check returns `checked`."""
    here = os.path.dirname(os.path.abspath(__file__))
    hold = {"STUB_TRIALS_HOLD": str(hold)} if hold else {}
    return {"PYTHONPATH": here, **hold, "STUB_TRIALS_CHECK": json.dumps(list(checked))}


if checked := os.environ.get("STUB_TRIALS_CHECK"):
    import types

    sys.modules["project.sweep.check"] = types.SimpleNamespace(
        check_inputs=lambda *args: tuple(json.loads(checked))
    )
if hold := os.environ.get("STUB_TRIALS_HOLD"):
    import project.sweep.storage
    import project.sweep.worker

    project.sweep.storage.HEARTBEAT_INTERVAL_S, project.sweep.storage.GRACE_PERIOD_S = 1, 3
    project.sweep.worker.fit_command = lambda configs, overlay, run_dir: [
        sys.executable,
        "-c",
        TRIAL,
        str(run_dir),
        hold,
    ]

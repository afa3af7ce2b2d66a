"""Python imports this module at start-up in every process whose PYTHONPATH holds this folder: tests/test_sweep.py
puts it there for its killed sweep, whose subject is the sweep's bookkeeping (workers, kills, re-queued trials), not
what a trial trains. In the sweep's processes (its workers included) the input check and the trials are stubs that
start in a fraction of a second instead of importing Lightning: a trial writes its run directory's config.yaml (it
is running), then waits while the file STUB_TRIALS_HOLD exists, then writes a summary.json and exits 0. A worker's
heartbeat comes every second, and a dead worker's trial is stale after 3 s instead of 20.
"""

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

if hold := os.environ.get("STUB_TRIALS_HOLD"):
    import types

    import project.sweep.storage
    import project.sweep.worker

    project.sweep.storage.HEARTBEAT_INTERVAL_S, project.sweep.storage.GRACE_PERIOD_S = 1, 3
    sys.modules["project.sweep.check"] = types.SimpleNamespace(
        check_inputs=lambda *args: ("val/loss", "minimize", {})
    )
    project.sweep.worker.fit_command = lambda configs, overlay, run_dir: [
        sys.executable,
        "-c",
        TRIAL,
        str(run_dir),
        hold,
    ]

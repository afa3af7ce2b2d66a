"""Where the suite's time goes: CPU seconds per test and per file, the processes a test started included.

    make test ARGS="-p tests.tools.cpu_usage"   # each xdist worker appends to runs/cpu_usage.jsonl
    python tests/tools/cpu_usage.py             # the files by CPU, then the 20 costliest tests

The suite is CPU-bound on 2 cores (wall ≈ CPU / 2), so CPU, not wall, is what a cut must lower: a test's wall
time also holds its waits for the other worker's processes. CPU = user + system of the pytest process (in-process
work: "self") and of the children it waited for (a launch, its DDP ranks, a sweep's trials).
"""

import collections
import json
import os
import resource
import sys
import time
from pathlib import Path

import pytest

OUT = Path(os.environ.get("CPU_USAGE_OUT", "runs/cpu_usage.jsonl"))


def _cpu() -> tuple[float, float]:
    own, children = (resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    (own, children), start = _cpu(), time.monotonic()
    yield
    own_after, children_after = _cpu()
    record = {
        "test": item.nodeid,
        "cpu": own_after - own + children_after - children,
        "self": own_after - own,
    }
    record |= {"wall": time.monotonic() - start, "worker": os.environ.get("PYTEST_XDIST_WORKER", "main")}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with OUT.open("a") as f:  # one short line per write: the workers' appends do not interleave
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    rows = [
        json.loads(line) for line in Path(sys.argv[1] if len(sys.argv) > 1 else OUT).read_text().splitlines()
    ]
    files: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
    for row in rows:
        totals = files[row["test"].split("::")[0]]
        totals[0], totals[1], totals[2] = (
            totals[0] + row["cpu"],
            totals[1] + row["self"],
            totals[2] + row["wall"],
        )
    print(f"{sum(r['cpu'] for r in rows):.0f} s of CPU in {len(rows)} tests\n\n  cpu   self   wall  file")
    for name, (cpu, own, wall) in sorted(files.items(), key=lambda item: -item[1][0]):
        print(f"{cpu:5.0f}  {own:5.0f}  {wall:5.0f}  {name}")
    print("\n  cpu   self   wall  test")
    for row in sorted(rows, key=lambda r: -r["cpu"])[:20]:
        print(f"{row['cpu']:5.1f}  {row['self']:5.1f}  {row['wall']:5.1f}  {row['test']}")

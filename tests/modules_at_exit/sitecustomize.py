"""Python imports this module at start-up in every process whose PYTHONPATH holds this folder: at exit, the process
writes the names in sys.modules to the file $MODULES_AT_EXIT, so that a test sees everything a command imported
anywhere, C extensions and lazy imports included (tests/conftest.py's modules_at_exit)."""

import atexit
import os
import sys

if path := os.environ.get("MODULES_AT_EXIT"):
    atexit.register(lambda: open(path, "w").write("\n".join(sorted(sys.modules))))

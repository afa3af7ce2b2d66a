"""A callback `make bench` adds to the shipped `make train` run: it records when the first optimizer step begins.

Added with `--trainer.callbacks+=bench_probe.FirstStepProbe` (scripts/ on PYTHONPATH); writes time.time() to
the file named by $BENCH_FIRST_STEP_FILE, so the bench can subtract the moment it started the process.
"""

import os
import time

from lightning.pytorch.callbacks import Callback


class FirstStepProbe(Callback):
    def __init__(self) -> None:
        self.done = False

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if not self.done and os.environ.get("BENCH_FIRST_STEP_FILE"):
            with open(os.environ["BENCH_FIRST_STEP_FILE"], "w") as f:
                f.write(repr(time.time()))
            self.done = True

"""A callback `make bench` adds to the shipped `make train` run: when each part of the start-up ended.

Added with `--trainer.callbacks+=bench_probe.FirstStepProbe` (scripts/ on PYTHONPATH). At the first optimizer step
it writes a JSON object of time.time() values to the file named by $BENCH_FIRST_STEP_FILE, so the bench can
subtract the moment it started the process:
- "imported": this module's import, while LightningCLI parses the config (the imports of torch, torchvision,
  lightning and the project are done; `dynamo_imported` says whether torch._dynamo came with them);
- "setup": the Trainer's setup hook (the config is parsed, the classes are built);
- "sanity_check": the sanity check's start (loggers, config.yaml, hyperparameters and the model summary are done);
- "first_step": the first optimizer step.
"""

import json
import os
import sys
import time

from lightning.pytorch.callbacks import Callback

IMPORTED = time.time()
DYNAMO_IMPORTED = "torch._dynamo" in sys.modules


class FirstStepProbe(Callback):
    def __init__(self) -> None:
        self.done = False
        self.marks = {"imported": IMPORTED}

    def setup(self, trainer, pl_module, stage: str) -> None:
        self.marks.setdefault("setup", time.time())

    def on_sanity_check_start(self, trainer, pl_module) -> None:
        self.marks.setdefault("sanity_check", time.time())

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if not self.done and os.environ.get("BENCH_FIRST_STEP_FILE"):
            marks = {**self.marks, "first_step": time.time(), "dynamo_imported": DYNAMO_IMPORTED}
            with open(os.environ["BENCH_FIRST_STEP_FILE"], "w") as f:
                json.dump(marks, f)
            self.done = True

"""What a run prints: Lightning messages that do not apply to this template are dropped, nothing else.

- "💡 Tip: ... try installing litlogger / litmodels": advertising for Lightning's cloud services, printed on every
  fit.
- CSVLogger's "Experiment logs directory ... exists and is not empty. Previous log files in this directory will be
  deleted": the run directory always holds config.yaml and TensorBoard's files next to metrics.csv, so it fired on
  every run, and the only file CSVLogger deletes, an earlier metrics.csv, is kept as metrics.<n>.csv first
  (project/run_dir.py keep_csv_history).
- torch's FutureWarning "`isinstance(treespec, LeafSpec)` is deprecated": raised by Lightning's own code
  (lightning/pytorch/utilities/_pytree.py creates LeafSpec objects) on every fit with torch 2.14; nothing a user of
  the template can change.
"""

import logging
import warnings

TIP_PREFIX = "💡 Tip:"


class _DropTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(TIP_PREFIX)


def drop_inapplicable_messages() -> None:
    warnings.filterwarnings("ignore", message=r"Experiment logs directory .* exists and is not empty")
    warnings.filterwarnings(
        "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning
    )
    for name in ("lightning.pytorch", "lightning.fabric"):
        # A record logged by a child logger reaches these loggers' handlers, but not their own filters.
        logger = logging.getLogger(name)
        for handler in [*logger.handlers, logger]:
            if not any(isinstance(f, _DropTips) for f in handler.filters):
                handler.addFilter(_DropTips())

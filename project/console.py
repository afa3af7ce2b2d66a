"""Lightning's messages that do not apply here: its "💡 Tip:" ads, CSVLogger's "logs directory ... is not empty"
(the run directory holds other files; the metrics.csv it deletes is kept first), torch's LeafSpec warning."""

import logging
import warnings


def _drop_tips(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("💡 Tip:")


def drop_inapplicable_messages() -> None:
    warnings.filterwarnings("ignore", message=r"Experiment logs directory .* exists and is not empty")
    warnings.filterwarnings(
        "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning
    )
    for name in ("lightning.pytorch", "lightning.fabric"):
        # A child logger's record reaches these loggers' handlers, but not their own filters.
        logger = logging.getLogger(name)
        for handler in [*logger.handlers, logger]:
            if _drop_tips not in handler.filters:
                handler.addFilter(_drop_tips)

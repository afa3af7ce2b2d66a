"""The template's callbacks, one concept per file."""

from project.callbacks.nonfinite_loss import NonFiniteLossGuard  # noqa: F401
from project.callbacks.pitfall_guards import PitfallGuards  # noqa: F401
from project.callbacks.progress_bar import ProgressBar  # noqa: F401
from project.callbacks.report import RunReport  # noqa: F401
from project.callbacks.run_checkpoint import RunCheckpoint  # noqa: F401
from project.callbacks.run_summary import RunSummary  # noqa: F401

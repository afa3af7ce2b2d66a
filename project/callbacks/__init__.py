"""One callback per file."""

from project.callbacks.graceful_stop import GracefulStop
from project.callbacks.nonfinite_loss import NonFiniteLossGuard
from project.callbacks.pitfall_guards import PitfallGuards
from project.callbacks.progress_bar import ProgressBar
from project.callbacks.report import RunReport
from project.callbacks.rng_state import RNGState
from project.callbacks.run_checkpoint import RunCheckpoint
from project.callbacks.run_summary import RunSummary

__all__ = [
    "RunReport",
    "GracefulStop",
    "NonFiniteLossGuard",
    "PitfallGuards",
    "ProgressBar",
    "RNGState",
    "RunCheckpoint",
    "RunSummary",
]

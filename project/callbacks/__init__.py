"""One callback per file."""

from project.callbacks.report import RunReport
from project.callbacks.run_summary import RunSummary

__all__ = ["RunReport", "RunSummary"]

"""One callback per file."""

from project.callbacks.run_summary import RunSummary

__all__ = ["RunSummary"]

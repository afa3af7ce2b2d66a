"""project/console.py: Lightning's advertising tips are dropped, its other messages still print."""

import logging

from project.console import drop_inapplicable_messages


def test_tips_are_dropped_and_other_lightning_info_kept():
    printed = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            printed.append(record.getMessage())

    parent, handler = logging.getLogger("lightning.pytorch"), Collect()
    level = parent.level
    parent.addHandler(handler)
    parent.setLevel(logging.INFO)  # as Lightning sets it on import
    try:
        drop_inapplicable_messages()
        drop_inapplicable_messages()  # every CLI call runs it: filters are not stacked
        # where Lightning's rank_zero_info logs (a child logger: its records reach the parent's handlers)
        child = logging.getLogger("lightning.pytorch.utilities.rank_zero")
        child.info("💡 Tip: For seamless cloud logging and experiment tracking, try installing [litlogger]")
        child.info("GPU available: False, used: False")
    finally:
        parent.removeHandler(handler)
        parent.setLevel(level)
    assert printed == ["GPU available: False, used: False"]
    assert sum(type(f).__name__ == "_DropTips" for f in handler.filters) == 1

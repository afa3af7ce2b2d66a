"""ProgressBar redraws at most every min_interval seconds, and always on an epoch's last batch."""

import pytest
from lightning.pytorch.callbacks import RichProgressBar

from project.callbacks import ProgressBar


class _Trainer:
    sanity_checking = False


@pytest.mark.claim("progress-bar-throttled")
def test_batches_between_redraws_are_skipped_but_the_last_is_drawn(monkeypatch):
    drawn = []
    monkeypatch.setattr(RichProgressBar, "on_train_batch_end", lambda self, t, m, o, b, i: drawn.append(i))
    monkeypatch.setattr(ProgressBar, "total_train_batches", property(lambda self: 20))
    bar = ProgressBar(min_interval=60.0)
    for i in range(20):
        bar.on_train_batch_end(_Trainer(), None, None, None, i)
    assert drawn == [0, 19]  # the first (nothing drawn yet) and the epoch's last
    drawn.clear()
    every = ProgressBar(min_interval=0.0)  # 0 = every batch, like RichProgressBar
    for i in range(5):
        every.on_train_batch_end(_Trainer(), None, None, None, i)
    assert drawn == [0, 1, 2, 3, 4]


def test_speed_column_shows_the_epochs_average_rate():
    # Redrawn every 0.5 s, an epoch's bar may get a single update: Rich's windowed estimate (task.speed) is then
    # None, and Lightning's column printed 0.00it/s.
    from rich.progress import Progress

    from project.callbacks.progress_bar import AverageSpeedColumn

    progress = Progress(auto_refresh=False, disable=True)
    task_id = progress.add_task("Epoch 0", total=20)
    progress.update(task_id, completed=20)
    progress.stop_task(task_id)
    task = progress.tasks[0]
    task.start_time = task.stop_time - 0.4  # 20 batches in 0.4 s
    assert task.speed is None
    assert AverageSpeedColumn(style="").render(task).plain == "50.00it/s"

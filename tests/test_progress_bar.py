"""ProgressBar redraws at most every min_interval seconds, and always on an epoch's last batch."""

from lightning.pytorch.callbacks import RichProgressBar

from project.callbacks import ProgressBar


class _Trainer:
    sanity_checking = False


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

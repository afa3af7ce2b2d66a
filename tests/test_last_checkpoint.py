"""`last.ckpt` is written at every epoch end, a full regular file, and not serialized twice in one step.

One in-process fit of the default config (build_cli: every callback, the atomic writer), 4 epochs of 2 batches,
with the selecting checkpoint replaced by one whose best can only be set in the first epoch: `val/acc_best` is a
running maximum, so under `mode: min` no later epoch improves on epoch 0's. Lightning 2.6's ModelCheckpoint then
wrote `last` at no later epoch end; BestModelCheckpoint must. Epoch 0 writes a new best file, so `last.ckpt` is
its hard link there (one serialization).
"""

import os

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from project.callbacks import BestModelCheckpoint


class WatchLast(Callback):
    """At each epoch start (and the train end): last.ckpt's global step, its link count, and the writes so far."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int, int, bool]] = []
        self.writes: list[str] = []

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.writes.append(f"{trainer.current_epoch}/{trainer.global_step}")

    def _look(self, trainer) -> None:
        path = os.path.join(trainer.checkpoint_callback.dirpath, "last.ckpt")
        if os.path.exists(path):
            step = torch.load(path, map_location="cpu", weights_only=True)["global_step"]
            self.seen.append((trainer.global_step, step, os.stat(path).st_nlink, os.path.islink(path)))

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._look(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        self._look(trainer)


@pytest.mark.slow  # trains through the CLI in-process (README: slow = 2-60 s)
@pytest.mark.claim("last-every-epoch-end")
def test_last_checkpoint_at_every_epoch_end(in_tmp):
    from project.cli import build_cli

    cli = build_cli(
        [
            "--run_dir",
            "r",
            "--trainer.max_epochs",
            "4",
            "--trainer.limit_train_batches",
            "2",
            "--trainer.limit_val_batches",
            "1",
            "--trainer.enable_progress_bar",
            "false",
        ],
        run=False,
    )
    trainer = cli.trainer
    old = trainer.checkpoint_callback
    assert isinstance(old, BestModelCheckpoint) and old.save_last is True
    never_better = BestModelCheckpoint(
        dirpath=old.dirpath,
        monitor="val/acc_best",
        mode="min",
        save_top_k=1,
        save_last=True,
        filename="best-{epoch:03d}",
        enable_version_counter=False,
    )
    watch = WatchLast()
    trainer.callbacks = [never_better if c is old else c for c in trainer.callbacks] + [watch]
    trainer.fit(cli.model, datamodule=cli.datamodule)

    # After each epoch end, last.ckpt holds that epoch's last step: a regular file (a hard link after epoch 0,
    # whose best file it shares; a file of its own after the later epochs, which wrote no best file).
    assert [(g, s) for g, s, _, _ in watch.seen] == [(2, 2), (4, 4), (6, 6), (8, 8)]
    assert [(n, link) for _, _, n, link in watch.seen[:3]] == [(2, False), (1, False), (1, False)]
    assert never_better.best_model_path.endswith("best-epoch=000.ckpt")
    # One serialization per epoch end (epoch 0: the best file only), plus StepCheckpoint's at the train end.
    assert watch.writes == ["0/2", "1/4", "2/6", "3/8", "4/8"]
    state = torch.load(os.path.join(old.dirpath, "last.ckpt"), map_location="cpu", weights_only=True)
    assert {"state_dict", "optimizer_states", "lr_schedulers", "loops", "callbacks"} <= set(state)

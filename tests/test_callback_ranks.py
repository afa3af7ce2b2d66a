"""Callbacks under DDP take the same collective steps on every rank, whatever state only some ranks have.

A collective that one rank skips, or enters alone, makes the others wait until the collective timeout (10 minutes
in configs/ddp.yaml). GracefulStop: a signal reaches the ranks one by one, or only one of them, and saving a
checkpoint is collective; Lightning's SIGTERM handler broadcasts from inside the signal handler (both hung
`make train-ddp` when rank 1 alone got SIGINT or SIGTERM; fixed, it exits 130/143 in ~5 s, by hand on 2026-12-01).
RunReport: the test confusion matrix is gathered from every rank, also from one whose test shard was empty. Two
callbacks stand for two ranks here; their strategy's reduce is the all-reduce between them.
"""

import os
import signal

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from project.callbacks import GracefulStop


class _Strategy:
    root_device = torch.device("cpu")

    def __init__(self, ranks: list[GracefulStop]) -> None:
        self.ranks, self.calls, self.value = ranks, 0, None

    def reduce(self, tensor, reduce_op: str):
        # An all-reduce: the ranks' values as they are when the first one enters it, the same result for each.
        assert reduce_op == "max"
        if self.calls % len(self.ranks) == 0:
            self.value = max(rank._received or 0 for rank in self.ranks)
        self.calls += 1
        return torch.tensor([self.value])


class _Trainer:
    world_size = 2
    num_training_batches = 20
    default_root_dir = "run"
    checkpoint_callbacks: list = []

    def __init__(self, strategy: _Strategy, rank: int) -> None:
        self.strategy, self.is_global_zero, self.saved = strategy, rank == 0, []

    def save_checkpoint(self, path: str) -> None:
        self.saved.append(path)


def _batch_end(stop: GracefulStop, trainer: _Trainer, batch_idx: int) -> int | None:
    try:
        stop.on_train_batch_end(trainer, None, None, None, batch_idx)
    except SystemExit as exit_:
        return exit_.code
    return None


@pytest.mark.claim("stop-signal-saves-and-exits")
@pytest.mark.parametrize("receivers", [(1,), (0,), (0, 1)], ids=["rank1-only", "rank0-only", "both"])
def test_every_rank_saves_and_exits_at_the_same_step(receivers, capsys):
    ranks = [GracefulStop(), GracefulStop()]
    strategy = _Strategy(ranks)
    trainers = [_Trainer(strategy, 0), _Trainer(strategy, 1)]
    assert [_batch_end(s, t, 3) for s, t in zip(ranks, trainers)] == [None, None]  # no signal: train on
    for r in receivers:
        ranks[r]._received = signal.SIGTERM  # what the handler records
    # Rank 0 decides first at step 4 (its flag may still be unset), rank 1 a moment later: they agree anyway.
    assert [_batch_end(s, t, 4) for s, t in zip(ranks, trainers)] == [143, 143]
    assert [t.saved for t in trainers] == [["run/checkpoints/last.ckpt"]] * 2
    assert capsys.readouterr().err.count("Saved run/checkpoints/last.ckpt") == 1  # rank 0 alone prints


@pytest.mark.claim("stop-signal-saves-and-exits")
def test_an_epochs_last_batch_waits_for_the_next_epoch_on_every_rank():
    ranks = [GracefulStop(), GracefulStop()]
    strategy = _Strategy(ranks)
    ranks[1]._received = signal.SIGINT
    trainers = [_Trainer(strategy, 0), _Trainer(strategy, 1)]
    assert [_batch_end(s, t, 19) for s, t in zip(ranks, trainers)] == [None, None]
    assert [_batch_end(s, t, 0) for s, t in zip(ranks, trainers)] == [130, 130]


@pytest.mark.claim("ddp-eval-counted-once")
def test_report_gathers_the_confusion_matrix_on_a_rank_without_test_batches():
    from types import SimpleNamespace

    from project.callbacks import RunReport

    report = RunReport()
    module = SimpleNamespace(num_classes=3, device=torch.device("cpu"))
    trainer = SimpleNamespace(world_size=2, is_global_zero=False, fast_dev_run=False)
    report.on_test_start(trainer, module)
    report.on_test_end(trainer, module)  # no on_test_batch_end on this rank: its shard was empty
    assert report.matrix is not None and report.matrix.sum() == 0  # compute() ran: the gather had all ranks


class _SignalInValidation(Callback):
    """Sends this process SIGTERM at the first validation batch after the sanity check."""

    def __init__(self) -> None:
        self.sent = False

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if not trainer.sanity_checking and not self.sent:
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.claim("stop-signal-saves-and-exits")
def test_sigterm_is_ours_alone_once_training_runs(tmp_path):
    # Lightning's SIGTERM handler broadcasts from inside the signal handler under DDP (a hang on the rank that got
    # the signal alone), and in any run stops validation half-way, exit code 0, nothing saved.
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel

    trainer = L.Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        callbacks=[GracefulStop(), ModelCheckpoint(dirpath=tmp_path / "checkpoints"), _SignalInValidation()],
        max_epochs=2,
        limit_train_batches=3,
        limit_val_batches=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as exit_:
            trainer.fit(BoringModel())
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert exit_.value.code == 143 and not trainer.received_sigterm
    # Validation of epoch 0 finished; the first step of epoch 1 ran, then last.ckpt was saved.
    assert torch.load(tmp_path / "checkpoints/last.ckpt", weights_only=False)["global_step"] == 4

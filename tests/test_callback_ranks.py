"""Callbacks under DDP take the same collective steps on every rank, whatever state only some ranks have.

A collective that one rank skips, or enters alone, makes the others wait until the collective timeout (10 minutes
in configs/ddp.yaml). RunCheckpoint on SIGTERM / Ctrl+C: a signal reaches the ranks one by one, or only one of
them, and saving a checkpoint is collective; Lightning's SIGTERM handler broadcasts from inside the signal handler
(both hung `make train-ddp` when rank 1 alone got SIGINT or SIGTERM; fixed, it exits 130/143 within seconds).
RunCheckpoint compares the ranks' flags (and rank 0's clock) every `check_every_n_steps` batches only (a host read
each time), so all ranks must count to the same step. NonFiniteLossGuard: a NaN loss on one rank stops every rank at the same
check, naming that rank's step. RunReport: the test confusion matrix is gathered from every rank, also from one
whose test shard was empty. Two callbacks stand for two ranks here; their strategy's reduce is the all-reduce
between them.
"""

import os
import signal

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from project.callbacks import NonFiniteLossGuard, RunCheckpoint
from project.callbacks.nonfinite_loss import NonFiniteLossError


class _Strategy:
    root_device = torch.device("cpu")

    def __init__(self, ranks: list[RunCheckpoint]) -> None:
        self.ranks, self.calls, self.value = ranks, 0, None

    def reduce(self, tensor, reduce_op: str):
        # An all-reduce: the ranks' values as they are when the first one enters it, the same result for each (twice
        # the signal number: no time interval is set, the clock's bit is 0).
        assert reduce_op == "max"
        if self.calls % len(self.ranks) == 0:
            self.value = max(2 * (rank._received or 0) for rank in self.ranks)
        self.calls += 1
        return torch.tensor([self.value])


class _Trainer:
    world_size = 2
    num_training_batches = 20
    global_step = 0
    loggers: list = []

    def __init__(self, strategy: _Strategy, rank: int) -> None:
        self.strategy, self.is_global_zero, self.saved = strategy, rank == 0, []

    def save_checkpoint(self, path: str, weights_only: bool = False) -> None:
        self.saved.append(path)


def _batch_end(stop: RunCheckpoint, trainer: _Trainer, batch_idx: int) -> int | None:
    try:
        stop.on_train_batch_end(trainer, None, None, None, batch_idx)
    except SystemExit as exit_:
        return exit_.code
    return None


def _run_until_exit(ranks, trainers, signal_at: int, receivers, signum, epochs: int = 3) -> list[tuple]:
    """Batch ends on both ranks, epoch by epoch, with the signal recorded on `receivers` before batch signal_at
    (counted over the whole run); returns each rank's (exit code, epoch, batch) or None."""
    exits: list = [None, None]
    n = 0
    for epoch in range(epochs):
        for batch_idx in range(_Trainer.num_training_batches):
            if n == signal_at:
                for r in receivers:
                    ranks[r]._received = signum  # what the handler records
            n += 1
            for r, (stop, trainer) in enumerate(zip(ranks, trainers)):
                code = _batch_end(stop, trainer, batch_idx)
                if code is not None and exits[r] is None:
                    exits[r] = (code, epoch, batch_idx)
            if any(exits):
                return exits
    return exits


@pytest.mark.claim("stop-signal-saves-and-exits")
@pytest.mark.parametrize("receivers", [(1,), (0,), (0, 1)], ids=["rank1-only", "rank0-only", "both"])
def test_every_rank_saves_and_exits_at_the_same_step(receivers, capsys):
    ranks = [RunCheckpoint(dirpath="run/checkpoints"), RunCheckpoint(dirpath="run/checkpoints")]
    strategy = _Strategy(ranks)
    trainers = [_Trainer(strategy, 0), _Trainer(strategy, 1)]
    every = ranks[0].check_every_n_steps
    # The signal arrives during batch 4; the ranks compare their flags after batch `every` - 1 (the first check),
    # and leave together there, rank 0 deciding first (its own flag may still be unset): they agree anyway.
    exits = _run_until_exit(ranks, trainers, 4, receivers, signal.SIGTERM)
    assert exits == [(143, 0, every - 1)] * 2
    assert strategy.calls == 2  # one all-reduce per rank in `every` batches, not one per batch
    last = os.path.abspath("run/checkpoints/last.ckpt")  # ModelCheckpoint makes its dirpath absolute
    assert [t.saved for t in trainers] == [[last]] * 2
    assert capsys.readouterr().err.count(f"Saved {last}") == 1  # rank 0 alone prints


@pytest.mark.claim("stop-signal-saves-and-exits")
def test_an_epochs_last_batch_waits_for_the_next_epoch_on_every_rank():
    # A check due on an epoch's last batch (batch 19 is the 20th: a multiple of 10) moves to the next epoch's first.
    ranks = [RunCheckpoint(dirpath="run/checkpoints"), RunCheckpoint(dirpath="run/checkpoints")]
    strategy = _Strategy(ranks)
    trainers = [_Trainer(strategy, 0), _Trainer(strategy, 1)]
    assert ranks[0].check_every_n_steps == 10 and _Trainer.num_training_batches == 20
    assert _run_until_exit(ranks, trainers, 15, (1,), signal.SIGINT) == [(130, 1, 0)] * 2


class _GuardStrategy:
    """All-reduce "max" between NonFiniteLossGuards of two ranks (each rank's current state)."""

    root_device = torch.device("cpu")

    def __init__(self, ranks: list[NonFiniteLossGuard]) -> None:
        self.ranks, self.calls = ranks, 0

    def reduce(self, tensor, reduce_op: str):
        assert reduce_op == "max"
        self.calls += 1
        return torch.stack([rank._found for rank in self.ranks]).max().reshape(1)


@pytest.mark.claim("nan-loss-stops-run")
def test_a_nan_loss_on_one_rank_stops_every_rank_at_the_same_check():
    from types import SimpleNamespace

    ranks = [NonFiniteLossGuard(check_every_n_steps=4), NonFiniteLossGuard(check_every_n_steps=4)]
    strategy = _GuardStrategy(ranks)
    module = SimpleNamespace(device=torch.device("cpu"))
    trainers = [
        SimpleNamespace(
            world_size=2,
            strategy=strategy,
            num_training_batches=20,
            global_step=0,
            current_epoch=0,
            optimizers=[],
            precision_plugin=None,
            checkpoint_callback=None,
        )
        for _ in ranks
    ]
    for guard, trainer in zip(ranks, trainers):
        guard.on_train_start(trainer, module)
    optimizers = [SimpleNamespace(defaults={"fused": True}, param_groups=[]) for _ in ranks]
    raised: list = [None, None]
    for batch_idx in range(8):
        for r, (guard, trainer) in enumerate(zip(ranks, trainers)):
            trainer.global_step = batch_idx
            guard.on_train_batch_start(trainer, module, None, batch_idx)
            loss = torch.tensor(float("nan") if (r, batch_idx) == (1, 1) else 1.0)
            guard.on_before_backward(trainer, module, loss)
            guard.on_before_optimizer_step(trainer, module, optimizers[r])
        # Both ranks are at the same batch when either enters the all-reduce, as under DDP.
        for r, (guard, trainer) in enumerate(zip(ranks, trainers)):
            try:
                guard.on_train_batch_end(trainer, module, None, None, batch_idx)
            except NonFiniteLossError as err:
                raised[r] = (batch_idx, str(err))
        if any(raised):
            break
    # Rank 1's flag skipped its own steps from batch 1 on; rank 0 saw finite losses. Both stop at the first
    # check (batch 3, after 4 batches); 2 reduces in 4 batches, not 1 per batch.
    assert [r[0] for r in raised] == [3, 3]
    assert all("became NaN or inf by global step 3, epoch 0;" in r[1] for r in raised)
    assert strategy.calls == 2
    assert float(ranks[1]._found) == 1.0 and float(ranks[0]._found) == 0.0  # the skip flag: rank 1 only


@pytest.mark.claim("nan-loss-stops-run")
def test_a_nan_gradient_under_ddp_sets_the_skip_flag_the_fused_optimizer_reads():
    # Under DDP the gradients, all-reduced, are the same on every rank: a non-finite one (after a finite loss) sets
    # the flag on each, so every rank skips the same step; finite gradients leave it at 0.
    from types import SimpleNamespace

    for value, expected in ((float("nan"), 1.0), (float("inf"), 1.0), (0.5, 0.0)):
        guard = NonFiniteLossGuard(check_every_n_steps=4)
        trainer = SimpleNamespace(world_size=2, global_step=0, current_epoch=0, precision_plugin=None)
        guard.on_train_start(trainer, SimpleNamespace(device=torch.device("cpu")))
        guard.on_train_batch_start(trainer, None, None, 0)
        guard.on_before_backward(trainer, None, torch.tensor(1.0))
        weight = torch.nn.Parameter(torch.zeros(3))
        weight.grad = torch.tensor([0.1, value, 0.2])
        optimizer = SimpleNamespace(defaults={"fused": True}, param_groups=[{"params": [weight]}])
        guard.on_before_optimizer_step(trainer, None, optimizer)
        assert float(guard._found) == expected, value
        assert optimizer.found_inf is guard._found  # the fused kernel skips the step when it is 1


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
    from lightning.pytorch.demos.boring_classes import BoringModel

    trainer = L.Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        callbacks=[RunCheckpoint(tmp_path / "checkpoints", monitor=None), _SignalInValidation()],
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


@pytest.mark.claim("ddp-timed-save-no-per-step-collective")
def test_timed_saves_compare_the_clock_every_ten_steps_under_ddp(monkeypatch):
    """RunCheckpoint's train_time_interval (configs/default.yaml: 30 min) under DDP: Lightning broadcasts rank 0's
    decision at every step; here it goes with the signal check, every 10 steps on every rank, and one process (no
    collective) still reads the clock every step."""
    from datetime import timedelta
    from types import SimpleNamespace

    from project.callbacks import run_checkpoint

    def checks(world_size: int) -> list[int]:
        """Steps of the collective checks, and of the saves (negative); 70 s a step: 30 minutes at step 26."""
        clock, seen = SimpleNamespace(monotonic=lambda: 0.0), []
        monkeypatch.setattr(run_checkpoint, "time", clock)
        callback = RunCheckpoint(train_time_interval=timedelta(minutes=30))
        reduce = lambda flag, reduce_op: seen.append(trainer.global_step) or flag  # noqa: E731
        trainer = SimpleNamespace(
            world_size=world_size,
            num_training_batches=100,
            enable_validation=True,  # on_train_start checks that validation logs the monitor
            is_global_zero=True,
            global_step=0,
            strategy=SimpleNamespace(root_device=torch.device("cpu"), reduce=reduce),
        )
        module = SimpleNamespace(automatic_optimization=True)
        callback.on_train_start(trainer, module)
        callback.write_last = lambda trainer: seen.append(-trainer.global_step)
        for batch_idx in range(40):
            trainer.global_step = batch_idx + 1
            clock.monotonic = lambda: 70.0 * trainer.global_step
            callback.on_train_batch_end(trainer, module, None, None, batch_idx)
        return seen

    assert checks(2) == [
        10,
        20,
        30,
        -30,
        40,
    ]  # read and agreed on every 10 steps: saved at the first after 26
    assert checks(1) == [-26]  # one process: no collective, the clock read at every step

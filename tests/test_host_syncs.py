"""The steady-state training step of the default config makes no device-to-host sync.

Counted at the dispatcher (a TorchDispatchMode), so a sync inside C++ counts as well as a Python `.item()`: every
op that needs a tensor's value on the host (`_local_scalar_dense` behind item/bool/int/float/tolist, `nonzero` and
the boolean-mask ops built on it, `unique`, `equal`, ...) and every copy from a non-CPU device to the CPU. On CPU
these cost little, but each one is a stall of the launch queue on a GPU, so the count on CPU is the count there.

The run: the default config through the CLI (build_cli, as `make train` builds it: progress bar, loggers,
checkpoints and every callback of configs/default.yaml), 2 epochs of 8 batches. The window: every training
batch, from its on_train_batch_start to the next one's (so it includes all batch-end hooks and the next fetch),
except two kinds, where host reads are allowed:
- the first batch of the run: PitfallGuards inspects the model once (then leaves trainer.callbacks);
- each epoch's last batch: its bucket holds validation, epoch-end logging, checkpoint writes, and
  NonFiniteLossGuard's read of its flag (the guard also reads every `check_every_n_steps` = 100 batches, more
  than this run has; RunCheckpoint reads no tensor in one process).
"""

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils._python_dispatch import TorchDispatchMode

from project.callbacks import NonFiniteLossGuard

# Ops that wait for a value on the host (CPU or CUDA): scalar reads, data-dependent output shapes.
SYNC_OPS = {
    "_local_scalar_dense",
    "is_nonzero",
    "equal",
    "nonzero",
    "nonzero_static",
    "masked_select",
    "unique",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "repeat_interleave",
    "bincount",
    "histc",
}


class SyncCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.bucket: list[str] | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        to_host = name in ("_to_copy", "copy_", "to") and any(
            isinstance(a, torch.Tensor) and a.device.type not in ("cpu", "meta") for a in args
        )
        if to_host:
            device = kwargs.get("device") or (args[0].device if name == "copy_" else None)
            to_host = device is not None and torch.device(device).type == "cpu"
        if (name in SYNC_OPS or to_host) and self.bucket is not None:
            self.bucket.append(name)
        return func(*args, **kwargs)


class CountPerBatch(Callback):
    """Counts syncs per training batch; put first in trainer.callbacks so that a batch's count starts before any
    other callback's hook for it."""

    def __init__(self) -> None:
        self.mode = SyncCounter()
        self.batches: dict[tuple[int, int], list[str]] = {}
        self.last_batch: set[tuple[int, int]] = set()
        self.armed: list[bool] = []  # the optimizer carried NonFiniteLossGuard's skip flag in this step

    def on_train_start(self, trainer, pl_module) -> None:
        self.mode.__enter__()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        key = (trainer.current_epoch, batch_idx)
        self.mode.bucket = self.batches.setdefault(key, [])
        if batch_idx + 1 == trainer.num_training_batches:
            self.last_batch.add(key)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.armed.append(hasattr(trainer.optimizers[0], "found_inf"))

    def on_train_end(self, trainer, pl_module) -> None:
        self.mode.__exit__(None, None, None)

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.mode.__exit__(None, None, None)


@pytest.mark.slow  # trains through the CLI (README: slow = 2-60 s)
@pytest.mark.claim("no-host-sync-per-step")
def test_no_host_sync_in_steady_state_steps(in_tmp):
    from project.cli import build_cli

    cli = build_cli(
        [
            "--run_dir",
            "r",
            "--trainer.max_epochs",
            "2",
            "--trainer.limit_train_batches",
            "8",
            "--trainer.limit_val_batches",
            "2",
        ],
        run=False,
    )
    counter = CountPerBatch()
    trainer = cli.trainer
    trainer.callbacks.insert(0, counter)
    guard = next(c for c in trainer.callbacks if isinstance(c, NonFiniteLossGuard))
    assert guard.check_every_n_steps > 16  # no periodic read inside this run's window (see the docstring)
    trainer.fit(cli.model, datamodule=cli.datamodule)

    assert len(counter.batches) == 16 and trainer.global_step == 16
    steady = {k: v for k, v in counter.batches.items() if k != (0, 0) and k not in counter.last_batch}
    assert len(steady) == 16 - 1 - 2  # the first batch and two epochs' last ones are left out
    assert {k: v for k, v in steady.items() if v} == {}
    # The counter does see syncs: the epoch's last batch reads the guard's flag and validates; the first
    # batch runs PitfallGuards' checks.
    assert all(counter.batches[k] for k in counter.last_batch) and counter.batches[(0, 0)]
    # The guard really is armed in every step (the fused kernel's skip flag), and PitfallGuards left.
    assert counter.armed == [True] * 16
    assert not any(type(c).__name__ == "PitfallGuards" for c in trainer.callbacks)

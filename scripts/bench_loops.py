"""The two sides of `make bench`: the template as `make train` runs it, and a hand-written PyTorch loop.

Both train the same ConvNet on the same batches (the data module's loader), with the same AdamW groups,
warmup-cosine schedule, label smoothing and precision, and both evaluate on the validation split each epoch.
Each returns per-epoch wall times: epoch 0 is warm-up, the rest is steady state.
"""

import contextlib
import io
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.profilers import Profiler
from torch import nn

from project.cli import CONFIG_DIR, RUN_DIR_ENV, ProjectCLI
from project.data import ImageClassificationDataModule
from project.models import ConvNet
from project.module import ClassificationModule
from project.schedule import warmup_cosine

DEFAULT_CONFIG = str(CONFIG_DIR / "default.yaml")


class EpochClock(Callback):
    """Wall time at each training epoch start and at the end of fit (validation and checkpoints included)."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.cpu: list[float] = []  # process CPU time at the same points (see steady_samples_per_s)
        self.end = 0.0
        self.step_seconds = 0.0
        self._t = 0.0

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.starts.append(time.perf_counter())
        self.cpu.append(time.process_time())

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._t = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if len(self.starts) > 1:  # steady-state epochs only
            self.step_seconds += time.perf_counter() - self._t

    def on_train_end(self, trainer, pl_module) -> None:
        self.end = time.perf_counter()
        self.cpu.append(time.process_time())


class FetchTimer(Profiler):
    """A profiler that only times Lightning's "fetch the next training batch" action (steady epochs)."""

    def __init__(self, clock: EpochClock) -> None:
        super().__init__()
        self.clock, self.seconds, self._t = clock, 0.0, 0.0

    def start(self, action_name: str) -> None:
        if action_name.endswith("train_dataloader_next"):
            self._t = time.perf_counter()

    def stop(self, action_name: str) -> None:
        if action_name.endswith("train_dataloader_next") and len(self.clock.starts) > 1:
            self.seconds += time.perf_counter() - self._t

    def summary(self) -> str:
        return ""


class _BenchCLI(ProjectCLI):
    """ProjectCLI (same config, same defaults) with the bench's clock and fetch timer attached before fit."""

    clock: EpochClock
    fetch: FetchTimer

    def before_fit(self) -> None:
        self.clock = EpochClock()
        self.fetch = FetchTimer(self.clock)
        self.trainer.callbacks.append(self.clock)
        self.trainer.profiler = self.fetch


def template_run(
    epochs: int, batch_size: int = 64, extra: list[str] | None = None, quiet: bool = True
) -> dict:
    """Train through ProjectCLI with configs/default.yaml as `make train` does (loggers, metrics, checkpoints,
    progress bar), minus the final test. Returns epoch times, samples per epoch and data-wait seconds."""
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        args = [
            "fit",
            "--config",
            DEFAULT_CONFIG,
            "--run_dir",
            tmp,
            "--test_after_fit",
            "false",
            "--trainer.max_epochs",
            str(epochs),
            "--data.init_args.batch_size",
            str(batch_size),
            *(extra or []),
        ]
        sink = io.StringIO() if quiet else None
        argv, sys.argv = sys.argv, sys.argv[:1]  # LightningCLI warns when it sees the bench's own flags
        with contextlib.redirect_stdout(sink) if sink else contextlib.nullcontext():
            try:
                cli = _BenchCLI(
                    ClassificationModule,
                    ImageClassificationDataModule,
                    subclass_mode_model=True,
                    subclass_mode_data=True,
                    save_config_kwargs={"overwrite": True},
                    args=args,
                )
            finally:
                os.environ.pop(RUN_DIR_ENV, None)
                sys.argv = argv
        clock, trainer = cli.clock, cli.trainer
        times = [b - a for a, b in zip(clock.starts, [*clock.starts[1:], clock.end], strict=True)]
        cpu = [b - a for a, b in zip(clock.cpu, clock.cpu[1:], strict=False)]
        steps = trainer.num_training_batches
        return {
            "epoch_seconds": times,
            "epoch_cpu_seconds": cpu,
            "samples_per_epoch": steps * batch_size,
            "fetch_seconds": cli.fetch.seconds,
            "step_seconds": clock.step_seconds,
            "val_acc": float(trainer.callback_metrics.get("val/acc", -1)),
        }


def raw_run(
    epochs: int,
    batch_size: int = 64,
    seed: int = 0,
    width: int = 32,
    lr: float = 3e-3,
    weight_decay: float = 0.05,
    label_smoothing: float = 0.1,
    warmup_epochs: float = 1.0,
    limit: int | None = None,
) -> dict:
    """The hand-written loop: zero_grad, forward, loss, backward, step, scheduler step; eval under no_grad.
    `limit` cuts each epoch to that many batches (and validation to one), like Trainer's limit_*_batches."""
    torch.manual_seed(seed)
    os.environ.setdefault("PL_GLOBAL_SEED", str(seed))
    dm = ImageClassificationDataModule(batch_size=batch_size)
    dm.setup("fit")
    train, val = dm.train_dataloader(), dm.val_dataloader()
    model = ConvNet(dm.num_classes, dm.in_channels, width=width)
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}], lr=lr
    )
    steps = min(len(train), limit or len(train))
    total, warmup = epochs * steps, round(warmup_epochs * steps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: warmup_cosine(s, warmup, total))
    loss_fn = nn.CrossEntropyLoss(label_smoothing=label_smoothing)
    starts, cpu, acc = [], [], 0.0
    for _ in range(epochs):
        starts.append(time.perf_counter())
        cpu.append(time.process_time())
        model.train()
        for i, (x, y) in enumerate(train):
            if i == steps:
                break
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            sched.step()
        model.eval()
        correct = count = 0
        with torch.no_grad():
            for i, (x, y) in enumerate(val):
                if limit and i == 1:
                    break
                correct += (model(x).argmax(1) == y).sum()
                count += len(y)
        acc = float(correct) / count  # one host sync per epoch
    end = time.perf_counter()
    cpu.append(time.process_time())
    times = [b - a for a, b in zip(starts, [*starts[1:], end], strict=True)]
    return {
        "epoch_seconds": times,
        "epoch_cpu_seconds": [b - a for a, b in zip(cpu, cpu[1:], strict=False)],
        "samples_per_epoch": steps * batch_size,
        "val_acc": acc,
    }


def steady_samples_per_s(run: dict) -> float:
    """Samples/s of the median steady-state epoch (train + validation + checkpoint): one slow epoch caused by
    another process on the machine does not move it."""
    import statistics

    return run["samples_per_epoch"] / statistics.median(run["epoch_seconds"][1:])


def steady_cpu_samples_per_s(run: dict) -> float:
    """The same per CPU-second of this process. With one intra-op thread (OMP_NUM_THREADS=1) this barely
    moves when other jobs share the cores, so it is the figure to trust on a busy machine."""
    import statistics

    return run["samples_per_epoch"] / statistics.median(run["epoch_cpu_seconds"][1:])


def loader_samples_per_s(in_memory: bool, epochs: int = 2, n: int | None = None) -> float:
    """Samples/s of the training loader alone (augmentation on): the DataLoader path or the in-memory path.
    With n, a synthetic digits-shaped split of n images (in-memory path only)."""
    if n is not None:
        from project.data.in_memory import InMemoryLoader

        loader = InMemoryLoader(
            torch.rand(n, 1, 8, 8),
            torch.randint(0, 10, (n,)),
            64,
            [0.5],
            [0.25],
            shuffle=True,
            augment="digits",
        )
    else:
        dm = ImageClassificationDataModule(in_memory=in_memory)
        dm.setup("fit")
        loader = dm.train_dataloader()
    count, t = 0, time.perf_counter()
    for _ in range(epochs):
        for _x, y in loader:
            count += len(y)
    return count / (time.perf_counter() - t)


def machine() -> dict:
    import platform

    import lightning

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {
        "cpus": cpus,
        "torch_threads": torch.get_num_threads(),
        "load_avg_1min_at_start": load,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name(0)
        if torch.cuda.is_available()
        else f"cpu ({platform.processor() or platform.machine()})",
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    }


def workdir() -> Path:
    return Path(__file__).resolve().parent.parent

"""The two sides of `make bench`: the template as `make train` runs it, and a hand-written PyTorch loop.

Both train the same ConvNet on the same batches (the data module's loader), with the same AdamW groups,
warmup-cosine schedule, label smoothing and precision, and both evaluate on the validation split each epoch.
template_run trains through the project's own CLI (project.cli.build_cli: the same parser, config.yaml writer,
callbacks and loggers as `make train`) and, with `raw=`, runs one RawLoop epoch before each of its own epochs
(EpochClock), so the two sides alternate epoch by epoch in one process. Epoch 0 is warm-up, the rest steady.
Each epoch is split into its training part (first batch to the last batch's end) and the rest (validation,
epoch-end logging, checkpoints), so per-step and per-epoch overheads are reported apart.
"""

import contextlib
import io
import os
import sys
import tempfile
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.profilers import Profiler
from torch import nn

from project.cli import CONFIG_DIR, ProjectCLI, build_cli
from project.data import ImageClassificationDataModule
from project.models import ConvNet
from project.schedule import warmup_cosine

DEFAULT_CONFIG = str(CONFIG_DIR / "default.yaml")
# Runs that report epoch figures only (template_run(whole_fit=False)) skip work that is in none of them, a third
# of such a run's time (docs/performance.md "Performance"): LogConfig, which has no hook inside
# the epochs (at setup it writes config.yaml and logs it, after fit the hyperparameter record), is left out; the
# callbacks below act during the epochs and stay, but their after-fit work (report.png) is skipped.
NO_EPOCH_HOOKS = ("LogConfig",)
AFTER_FIT_ONLY = ("RunReport",)


class EpochClock(Callback):
    """Wall and CPU time of each template epoch (training, validation and checkpoints), nothing per batch.

    With a RawLoop it also runs one raw epoch at each epoch start, before the template's epoch begins: each
    template epoch is compared with the raw epoch that ran a moment before it on the same cores, so a slow
    patch of a shared machine hits both sides of a pair. It is put first in the callback list, so the raw
    epoch runs before any template hook of that epoch and is excluded from the template's time.
    Only epoch hooks: a callback costs every training step a few microseconds per hook it is called for.
    """

    def __init__(self, raw: "RawLoop | None" = None, skip_after_fit: bool = False) -> None:
        self.raw = raw
        self.skip_after_fit = skip_after_fit
        self.starts: list[float] = []  # template epoch k runs from starts[k] to ends[k]
        self.ends: list[float] = []
        self.cpu_starts: list[float] = []  # process CPU time at the same points
        self.cpu_ends: list[float] = []
        self.train_ends: list[float] = []  # the last training batch's end, before validation
        self.raw_seconds: list[float] = []
        self.raw_cpu_seconds: list[float] = []
        self.raw_train_seconds: list[float] = []
        self.fit_seconds = 0.0  # ProjectCLI's before_fit to after_fit: the whole trainer.fit

    def figures(self, steps_per_epoch: int, batch_size: int) -> dict:
        """Each epoch's wall, CPU and training-part seconds, and with a raw loop the same of its epochs ("raw")."""
        result = {
            "epoch_seconds": [b - a for a, b in zip(self.starts, self.ends, strict=True)],
            "epoch_cpu_seconds": [b - a for a, b in zip(self.cpu_starts, self.cpu_ends, strict=True)],
            "train_seconds": [b - a for a, b in zip(self.starts, self.train_ends, strict=True)],
            "steps_per_epoch": steps_per_epoch,
            "samples_per_epoch": steps_per_epoch * batch_size,
        }
        if self.raw is not None:
            result["raw"] = {
                "epoch_seconds": self.raw_seconds,
                "epoch_cpu_seconds": self.raw_cpu_seconds,
                "train_seconds": self.raw_train_seconds,
                "samples_per_epoch": self.raw.samples_per_epoch,
            }
        return result

    def _close(self) -> None:
        if len(self.ends) < len(self.starts):
            self.ends.append(time.perf_counter())
            self.cpu_ends.append(time.process_time())

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._close()
        if self.raw is not None:
            wall, cpu, train = self.raw.epoch()
            self.raw_seconds.append(wall)
            self.raw_cpu_seconds.append(cpu)
            self.raw_train_seconds.append(train)
        self.starts.append(time.perf_counter())
        self.cpu_starts.append(time.process_time())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx + 1 == trainer.num_training_batches:  # one compare per step; runs before the other hooks
            self.train_ends.append(time.perf_counter())

    def on_train_end(self, trainer, pl_module) -> None:
        self._close()
        if self.skip_after_fit:
            # The clock has stopped: the after-fit work (report.png, the hparams record) is in no epoch figure of
            # this run, and costs seconds of bench time per run. A new list: Lightning iterates the one it read.
            trainer.callbacks = [c for c in trainer.callbacks if type(c).__name__ not in AFTER_FIT_ONLY]


class StepTimer(Callback):
    """Per-step timing for data_wait_fraction (separate runs: its hooks and profiler cost every step)."""

    def __init__(self, clock: EpochClock) -> None:
        self.clock, self.step_seconds, self._t = clock, 0.0, 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._t = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if len(self.clock.starts) > 1:  # steady-state epochs only
            self.step_seconds += time.perf_counter() - self._t


class FetchTimer(Profiler):
    """A profiler that only times two of Lightning's actions in steady epochs: "fetch the next training batch" and
    "save_checkpoint" (the Trainer's whole checkpoint write: gathering the state, torch.save, fsync, rename)."""

    def __init__(self, clock: EpochClock) -> None:
        super().__init__()
        self.clock, self.seconds, self._t = clock, 0.0, 0.0
        # The part of `seconds` spent on each epoch's first fetch (a loader's per-epoch start: workers, shuffle).
        self.first_seconds, self._epoch = 0.0, 0
        self.checkpoint_seconds, self._c = 0.0, 0.0

    def start(self, action_name: str) -> None:
        if action_name.endswith("train_dataloader_next"):
            self._t = time.perf_counter()
        elif action_name == "save_checkpoint":
            self._c = time.perf_counter()

    def stop(self, action_name: str) -> None:
        if action_name == "save_checkpoint" and len(self.clock.starts) > 1:
            self.checkpoint_seconds += time.perf_counter() - self._c
        if action_name.endswith("train_dataloader_next") and len(self.clock.starts) > 1:
            took = time.perf_counter() - self._t
            self.seconds += took
            if self._epoch != len(self.clock.starts):
                self._epoch = len(self.clock.starts)
                self.first_seconds += took

    def summary(self) -> str:
        return ""


def time_hooks(callback, hooks: tuple[str, ...], clock: EpochClock) -> list[float]:
    """Wrap the callback's hooks (instance attributes) with a timer; the returned one-item list accumulates the
    seconds spent in them during steady-state epochs."""
    total = [0.0]
    for name in hooks:
        fn = getattr(callback, name)

        def timed(*args, _fn=fn, **kwargs):
            t = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                if len(clock.starts) > 1:
                    total[0] += time.perf_counter() - t

        setattr(callback, name, timed)
    return total


class _BenchCLI(ProjectCLI):
    """ProjectCLI (same config, same defaults, built by build_cli) with the bench's clock attached before fit."""

    raw_loop: "RawLoop | None" = None  # set by template_run
    whole_fit = True
    instrument = False
    drop: tuple[str, ...] = ()  # callback class names taken out before fit (an option's "without X")
    clock: EpochClock
    steps: "StepTimer | None" = None
    fetch: "FetchTimer | None" = None

    def before_fit(self) -> None:
        super().before_fit()
        self.clock = EpochClock(self.raw_loop, skip_after_fit=not self.whole_fit)
        drop = (*self.drop, *(() if self.whole_fit else NO_EPOCH_HOOKS))
        kept = [c for c in self.trainer.callbacks if type(c).__name__ not in drop]
        self.trainer.callbacks = [self.clock, *kept]  # first: its raw epoch runs before the template's hooks
        self.bar_seconds = None
        if self.instrument:
            self.steps, self.fetch = StepTimer(self.clock), FetchTimer(self.clock)
            self.trainer.callbacks.append(self.steps)
            self.trainer.profiler = self.fetch
            bar = self.trainer.progress_bar_callback
            if bar is not None:  # every hook the bar implements: per batch and per epoch (its redraws)
                hooks = [
                    h
                    for h in dir(Callback)
                    if h.startswith("on_") and getattr(type(bar), h) is not getattr(Callback, h)
                ]
                self.bar_seconds = time_hooks(bar, tuple(hooks), self.clock)
        self._fit_start = time.perf_counter()

    def after_fit(self) -> None:
        self.clock.fit_seconds = time.perf_counter() - self._fit_start
        if (
            not self.config.fit.test_after_fit
        ):  # with a test to follow, the bench stops here: the fit is timed
            super().after_fit()


def template_run(
    epochs: int,
    batch_size: int = 64,
    extra: list[str] | None = None,
    quiet: bool = True,
    raw: dict | None = None,
    instrument: bool = False,
    drop: tuple[str, ...] = (),
    whole_fit: bool = True,
    test_after_fit: bool = False,
) -> dict:
    """Train as `make train` does (`python -m project fit` with configs/default.yaml through build_cli: loggers,
    metrics, checkpoints, config.yaml, progress bar), minus the final test. Returns epoch wall and CPU times,
    each epoch's training part, samples per epoch and the whole fit's wall time.

    raw: RawLoop keyword arguments; one hand-written-loop epoch then runs before each template epoch (see
        EpochClock) and the result has a "raw" entry with the same keys.
    instrument: also time each step and each batch fetch ("step_seconds", "fetch_seconds"): for
        data_wait_fraction, in runs of their own since the timers slow every step; also the seconds spent in
        the progress bar's per-batch hooks ("bar_seconds").
    drop: names of callback classes removed from the config's list (options measured as "without X").
    whole_fit: False leaves out work that is in no epoch figure (NO_EPOCH_HOOKS' callbacks, AFTER_FIT_ONLY's
        after-fit work once the clock has stopped): for runs whose figures are epochs only; "fit_seconds" then
        misses that work.
    test_after_fit: run the fit as `make train` does, with a test to follow (work deferred to the test, such as
        report.png and the HPARAMS record, is then not done at the fit's end), but stop after the timed fit: the
        test itself is not run."""
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        args = [
            "fit",
            "--run_dir",
            tmp,
            "--test_after_fit",
            str(test_after_fit).lower(),
            "--trainer.max_epochs",
            str(epochs),
            "--data.init_args.batch_size",
            str(batch_size),
            *(extra or []),
        ]
        sink = io.StringIO() if quiet else None
        _BenchCLI.raw_loop = RawLoop(epochs, batch_size, **raw) if raw is not None else None
        _BenchCLI.instrument, _BenchCLI.drop, _BenchCLI.whole_fit = instrument, drop, whole_fit
        argv, sys.argv = sys.argv, sys.argv[:1]  # LightningCLI warns when it sees the bench's own flags
        with contextlib.redirect_stdout(sink) if sink else contextlib.nullcontext():
            try:
                cli = build_cli(args, cli_class=_BenchCLI)
            finally:
                sys.argv = argv
        clock, trainer = cli.clock, cli.trainer
        result = {
            **clock.figures(trainer.num_training_batches, batch_size),
            "fit_seconds": clock.fit_seconds,
            "val_acc": float(trainer.callback_metrics.get("val/acc", -1)),
        }
        if instrument:
            result["fetch_seconds"], result["step_seconds"] = cli.fetch.seconds, cli.steps.step_seconds
            result["first_fetch_seconds"] = cli.fetch.first_seconds
            result["checkpoint_seconds"] = cli.fetch.checkpoint_seconds
            result["bar_seconds"] = cli.bar_seconds[0] if cli.bar_seconds is not None else 0.0
        if clock.raw is not None:
            result["raw"]["val_acc"] = clock.raw.val_acc
        _BenchCLI.raw_loop, _BenchCLI.instrument, _BenchCLI.drop, _BenchCLI.whole_fit = None, False, (), True
        return result


class BareModule(L.LightningModule):
    """The raw loop's work as a LightningModule: no metrics, no logging, nothing but Lightning's own loop.

    training_step returns the loss (automatic optimization: Lightning's closure, zero_grad, backward, step), the
    scheduler steps per optimizer step, validation counts correct predictions on the device and reads them once
    per epoch, as the raw loop does. With `bare_lightning_run` it measures what Lightning's loop alone costs against
    the tuned raw loop, so the template's own share of its overhead is the rest.
    """

    def __init__(self, loop: "RawLoop") -> None:
        super().__init__()
        self.loop = loop
        self.model, self.loss_fn = loop.model, loop.loss_fn

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        # normalised per batch, as the raw loop and the template do
        return self.loop.prepare(batch, dataloader_idx)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.loss_fn(self.model(x.contiguous(memory_format=self.loop.memory_format)), y)

    def on_validation_epoch_start(self) -> None:
        self.correct, self.count = torch.zeros((), dtype=torch.long), 0

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(x.contiguous(memory_format=self.loop.memory_format))
        self.correct += (logits.argmax(1) == y).sum()
        self.count += len(y)

    def on_validation_epoch_end(self) -> None:
        self.val_acc = float(self.correct) / self.count  # one host read per epoch, as the raw loop

    def configure_optimizers(self):
        return {
            "optimizer": self.loop.opt,
            "lr_scheduler": {"scheduler": self.loop.sched, "interval": "step"},
        }


def bare_lightning_run(epochs: int, batch_size: int = 64, raw: dict | None = None, **loop: Any) -> dict:
    """Lightning's loop alone (BareModule on a Trainer with no logger, checkpoint, progress bar, summary or sanity
    check, deterministic as the config) on the tuned raw loop's model, optimizer, schedule and loaders, with one
    raw-loop epoch of `raw` before each of its epochs (EpochClock), as template_run."""
    return _lightning_run(
        BareModule,
        epochs,
        batch_size,
        raw,
        loop,
        logger=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )


def _lightning_run(
    module: type, epochs: int, batch_size: int, raw: dict | None, loop: dict, **trainer: Any
) -> dict:
    """`module` on the tuned raw loop's model, optimizer, schedule and loaders, trained by a Trainer with
    `trainer`'s arguments besides the shared ones (no progress bar or summary, deterministic as the config), the
    EpochClock first among its callbacks: the figures of its epochs."""
    side = RawLoop(epochs, batch_size, fused=True, channels_last=True, **loop)
    clock = EpochClock(RawLoop(epochs, batch_size, **raw) if raw is not None else None)
    fit = L.Trainer(
        max_epochs=epochs,
        limit_train_batches=side.steps,
        limit_val_batches=1 if side.limit else None,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        **{**trainer, "callbacks": [clock, *trainer.get("callbacks", [])]},
    )
    with contextlib.redirect_stdout(io.StringIO()):
        fit.fit(module(side), side.train, side.val)
    return clock.figures(fit.num_training_batches, batch_size)


class StockModule(BareModule):
    """BareModule plus the template's logged metrics, written the stock Lightning way: the epoch's training loss
    and accuracy from sums kept on the device (logged once per epoch, as the template does: a per-step self.log
    would cost this side more), and torchmetrics objects for the validation loss, accuracy, top-5 and best
    accuracy, handed to self.log. With `stock_lightning_run` it is Lightning's ceiling for the template's job."""

    def __init__(self, loop: "RawLoop") -> None:
        super().__init__(loop)
        from torchmetrics import MaxMetric, MeanMetric
        from torchmetrics.classification import MulticlassAccuracy

        classes = loop.num_classes
        self.val_loss, self.val_acc_best = MeanMetric(), MaxMetric()
        self.val_acc = MulticlassAccuracy(num_classes=classes, average="micro")
        self.val_acc5 = MulticlassAccuracy(num_classes=classes, average="micro", top_k=5)
        self.sums, self.steps, self.samples = None, 0, 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(x.contiguous(memory_format=self.loop.memory_format))
        loss = self.loss_fn(logits, y)
        sums = torch.stack((loss.detach(), (logits.argmax(1) == y).sum().to(loss.dtype)))
        self.sums = sums if self.sums is None else self.sums + sums
        self.steps, self.samples = self.steps + 1, self.samples + len(y)
        return loss

    def on_train_epoch_end(self) -> None:
        self.log("train/loss", self.sums[0] / self.steps)
        self.log("train/acc", self.sums[1] / self.samples)
        self.sums, self.steps, self.samples = None, 0, 0

    def on_validation_epoch_start(self) -> None:
        pass  # BareModule's counters are not used here

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(x.contiguous(memory_format=self.loop.memory_format))
        self.val_loss.update(self.loss_fn(logits, y), weight=len(y))
        self.val_acc.update(logits, y)
        self.val_acc5.update(logits, y)

    def on_validation_epoch_end(self) -> None:
        self.val_acc_best.update(self.val_acc.compute())
        self.log("val/loss", self.val_loss)
        self.log("val/acc", self.val_acc)
        self.log("val/acc_top5", self.val_acc5)
        self.log(
            "val/acc_best", self.val_acc_best.compute()
        )  # the metric objects: computed and reset by Lightning


def stock_lightning_run(epochs: int, batch_size: int = 64, raw: dict | None = None, **loop: Any) -> dict:
    """Lightning doing the template's job with its stock parts, on the tuned loop's model, optimizer, schedule and
    loaders: StockModule's metrics, ModelCheckpoint (the best file by val/loss and last.ckpt at every epoch end),
    TensorBoard and CSV loggers, a per-epoch LearningRateMonitor, deterministic as the config; no progress bar,
    which the template draws (so this side has less to do). With `raw`, one raw-loop epoch before each of its
    epochs (EpochClock), as template_run."""
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    with tempfile.TemporaryDirectory(prefix="bench-stock-") as tmp:
        return _lightning_run(
            StockModule,
            epochs,
            batch_size,
            raw,
            loop,
            logger=[
                TensorBoardLogger(tmp, name="", version="", default_hp_metric=False),
                CSVLogger(tmp, name="", version=""),
            ],
            callbacks=[
                ModelCheckpoint(
                    dirpath=f"{tmp}/checkpoints",
                    filename="best-{epoch:03d}",
                    monitor="val/loss",
                    mode="min",
                    save_top_k=1,
                    save_last=True,
                ),
                LearningRateMonitor(logging_interval="epoch"),
            ],
            log_every_n_steps=10,
        )


def config_data_args() -> dict:
    """data.init_args of configs/default.yaml."""
    import yaml

    with open(DEFAULT_CONFIG) as f:
        return dict(yaml.safe_load(f)["data"]["init_args"])


class RawLoop:
    """The hand-written loop, one epoch per call: zero_grad, forward, loss, backward, step, scheduler step;
    then accuracy on the validation split under no_grad. Its own model, optimizer and loader (same split).

    The loop the seeds show uses the default AdamW and NCHW tensors. `fused` and `channels_last` give it the
    template's shipped settings (fused AdamW kernel, NHWC), to separate what Lightning's loop costs from what
    those settings gain. `limit` cuts each epoch to that many batches (and validation to one). `save_to`: also
    compute the validation loss and top-5 accuracy, as the template logs them, and save model, optimizer and
    scheduler state there after each epoch, as the template's last.ckpt: the hand-written loop that does the
    template's work (fit_seconds).
    """

    def __init__(
        self,
        epochs: int,
        batch_size: int = 64,
        seed: int = 0,
        width: int = 32,
        lr: float = 3e-3,
        weight_decay: float = 0.05,
        label_smoothing: float = 0.1,
        warmup_epochs: float = 1.0,
        limit: int | None = None,
        fused: bool = False,
        channels_last: bool = False,
        save_to: str | None = None,
    ) -> None:
        torch.manual_seed(seed)
        os.environ.setdefault("PL_GLOBAL_SEED", str(seed))
        # The data settings of configs/default.yaml (augmentation off there; the class default is on), so both
        # sides get the same batches' worth of work.
        dm = ImageClassificationDataModule(**{**config_data_args(), "batch_size": batch_size})
        dm.setup("fit")
        self.train, self.val, self.limit = dm.train_dataloader(), dm.val_dataloader(), limit
        # The batches as training gets them: normalised per batch, as the data module does after the transfer
        self.prepare = dm.on_after_batch_transfer
        self.num_classes = dm.num_classes
        self.model = ConvNet(dm.num_classes, dm.in_channels, width=width)
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.model.to(memory_format=self.memory_format)
        decay = [p for p in self.model.parameters() if p.ndim > 1]
        no_decay = [p for p in self.model.parameters() if p.ndim <= 1]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW(groups, lr=lr, **({"fused": True} if fused else {}))
        self.steps = min(len(self.train), limit or len(self.train))
        self.epochs, total, warmup = epochs, epochs * self.steps, round(warmup_epochs * self.steps)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: warmup_cosine(s, warmup, total))
        self.loss_fn = nn.CrossEntropyLoss(label_smoothing=label_smoothing)
        self.samples_per_epoch = self.steps * batch_size
        self.val_acc = 0.0
        self.save_to = save_to

    def epoch(self) -> tuple[float, float, float]:
        """Runs one epoch; returns its (wall seconds, process CPU seconds, wall seconds of the training part)."""
        t, c = time.perf_counter(), time.process_time()
        model, opt, sched, loss_fn = self.model, self.opt, self.sched, self.loss_fn
        model.train()
        for i, batch in enumerate(self.train):
            if i == self.steps:
                break
            x, y = self.prepare(batch, 0)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x.contiguous(memory_format=self.memory_format)), y)
            loss.backward()
            opt.step()
            sched.step()
        train = time.perf_counter() - t
        model.eval()
        correct = count = top5 = loss_sum = 0
        with torch.no_grad():
            for i, batch in enumerate(self.val):
                if self.limit and i == 1:
                    break
                x, y = self.prepare(batch, 0)
                logits = model(x.contiguous(memory_format=self.memory_format))
                correct += (logits.argmax(1) == y).sum()
                count += len(y)
                if self.save_to:
                    loss_sum += loss_fn(logits, y) * len(y)
                    top5 += (logits.topk(5, 1).indices == y[:, None]).any(1).sum()
        self.val_acc = float(correct) / count  # one host sync per epoch
        if self.save_to:
            self.val_loss, self.val_acc5 = float(loss_sum) / count, float(top5) / count
            state = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}
            torch.save(state, self.save_to)
        return time.perf_counter() - t, time.process_time() - c, train

    def fit(self) -> float:
        """All epochs; returns the wall seconds."""
        t = time.perf_counter()
        for _ in range(self.epochs):
            self.epoch()
        return time.perf_counter() - t


def steady_samples_per_s(run: dict) -> float:
    """Samples/s of the median steady-state epoch (train + validation + checkpoint): one slow epoch caused by
    another process on the machine does not move it."""
    import statistics

    return run["samples_per_epoch"] / statistics.median(run["epoch_seconds"][1:])


def loader_samples_per_s(in_memory: bool, epochs: int = 2, n: int | None = None) -> float:
    """Samples/s of the training loader alone (pixels, before the per-batch augmentation and normalisation every
    path shares): the DataLoader path or the in-memory path.
    With n, a synthetic digits-shaped split of n images (in-memory path only)."""
    if n is not None:
        from project.data.loaders import ResumableDataLoader, TensorImages, batched

        images, labels = torch.rand(n, 1, 8, 8), torch.randint(0, 10, (n,))
        loader = ResumableDataLoader(TensorImages(images, labels), 64, collate_fn=batched)
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
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU: {cpu_model()}",
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    }


def cpu_model() -> str:
    """The CPU's model name as `lscpu` shows it (Linux: /proc/cpuinfo), else what the platform module knows."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({platform.machine()})"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def overheads_ms(run: dict) -> tuple[list[float], list[float]]:
    """Per steady-state epoch pair: the template's extra milliseconds per training step (its training part minus
    the raw loop's, over the steps) and per epoch (the rest of its epoch, validation, logging, checkpoints and
    epoch hooks, minus the raw loop's validation)."""
    raw, steps = run["raw"], run["steps_per_epoch"]
    per_step, per_epoch = [], []
    for te, tt, re, rt in zip(
        run["epoch_seconds"][1:], run["train_seconds"][1:], raw["epoch_seconds"][1:], raw["train_seconds"][1:]
    ):
        per_step.append((tt - rt) / steps * 1000)
        per_epoch.append(((te - tt) - (re - rt)) * 1000)
    return per_step, per_epoch


def epoch_ratios(run: dict) -> list[float]:
    """Per steady-state epoch of an interleaved run: raw loop epoch seconds / template epoch seconds (the
    samples per epoch are equal), i.e. the template's throughput relative to the raw loop's."""
    raw = run["raw"]
    assert raw["samples_per_epoch"] == run["samples_per_epoch"], "the two sides must see the same batches"
    return [r / t for r, t in zip(raw["epoch_seconds"][1:], run["epoch_seconds"][1:], strict=True)]

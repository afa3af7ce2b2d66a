"""`make bench`: the template against a hand-written PyTorch loop and against stock Lightning, same settings.

    python scripts/bench.py            # full: 5 rounds, 5 epochs a run
    python scripts/bench.py --quick    # 2 rounds, 3 epochs a run
    python scripts/bench.py --smoke    # 1 round of 2 batches an epoch: every key, no measurement (make test)

The three sides and how they are paired: docs/performance.md. Writes runs/bench/bench.json, prints a markdown table.
"""

import argparse
import contextlib
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [
    str(ROOT / "scripts"),
    str(ROOT),
]  # this checkout's `project`; `bench` for the probe's class path

import lightning as L  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from torch import nn  # noqa: E402

from project.cli import ProjectCLI, auto_precision, build_cli  # noqa: E402
from project.data import ImageClassificationDataModule  # noqa: E402
from project.models import ConvNet  # noqa: E402
from project.optim import warmup_cosine  # noqa: E402

DEFAULT = yaml.safe_load((ROOT / "configs/default.yaml").read_text())
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # where `accelerator: auto` goes
PRECISION = auto_precision()
PROFILES = {  # rounds, epochs a run, batches an epoch (None: all), epochs of the whole fit, default runs, options
    "full": dict(rounds=5, epochs=5, limit=None, fit_epochs=15, default_runs=3, option_rounds=3, compile=True),
    "quick": dict(rounds=2, epochs=3, limit=None, fit_epochs=15, default_runs=1, option_rounds=1, compile=True),
    "smoke": dict(rounds=1, epochs=2, limit=2, fit_epochs=2, default_runs=1, option_rounds=1, compile=False),
}  # fmt: skip
# Options whose effect stands out of the run-to-run noise (docs/performance.md): name -> the template's extra flags.
OPTIONS = {"bf16_mixed": "--trainer.precision=bf16-mixed", "compile": "--model.init_args.compile=true"}


def now() -> float:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


class RawLoop:
    """The hand-written loop, one epoch per call, with the template's settings (configs/default.yaml) and its own
    model, optimizer and loaders. `limit`: that many batches an epoch, one for validation. `save_to`: also the
    validation loss and top-5, and model, optimizer and scheduler state saved there each epoch (the template's
    work, for the whole-fit figure)."""

    def __init__(self, epochs: int, limit: int | None = None, save_to: str | None = None) -> None:
        torch.manual_seed(0)
        model, data = DEFAULT["model"]["init_args"], DEFAULT["data"]["init_args"]
        dm = ImageClassificationDataModule(**data)
        dm._device = lambda: (
            DEVICE
        )  # the in-memory loader's batches on the training device, as under the Trainer
        dm.setup("fit")
        self.train, self.val, self.limit, self.save_to = (
            dm.train_dataloader(),
            dm.val_dataloader(),
            limit,
            save_to,
        )
        self.prepare = dm.on_after_batch_transfer  # normalised per batch, as for the template
        self.model = ConvNet(dm.num_classes, dm.in_channels, **model["model"]["init_args"])
        self.model.to(DEVICE, memory_format=torch.channels_last)
        params = list(self.model.parameters())
        groups = [
            {"params": [p for p in params if p.ndim > 1]},
            {"params": [p for p in params if p.ndim <= 1]},
        ]
        groups[1]["weight_decay"] = 0.0
        self.opt = torch.optim.AdamW(groups, **model["optimizer"]["init_args"], fused=True)
        self.steps = min(len(self.train), limit or len(self.train))
        total, warmup = (
            epochs * self.steps,
            round(model["scheduler"]["init_args"]["warmup_epochs"] * self.steps),
        )
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: warmup_cosine(s, warmup, total))
        self.loss_fn = nn.CrossEntropyLoss(label_smoothing=model["label_smoothing"])
        self.epochs, self.samples = epochs, self.steps * data["batch_size"]
        dtype = (
            torch.bfloat16 if PRECISION == "bf16-mixed" else torch.float16
        )  # 16-mixed: no loss scaling here
        self.autocast = lambda: torch.autocast(DEVICE.type, dtype=dtype, enabled=PRECISION != "32-true")

    def forward(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.prepare(batch, 0)
        with self.autocast():
            return self.model(x.contiguous(memory_format=torch.channels_last)).float(), y

    def epoch(self) -> tuple[float, float]:
        """One epoch; returns its wall seconds and those of its training part."""
        t = now()
        self.model.train()
        for i, batch in enumerate(self.train):
            if i == self.steps:
                break
            self.opt.zero_grad(set_to_none=True)
            self.loss_fn(*self.forward(batch)).backward()
            self.opt.step()
            self.sched.step()
        train = now() - t
        self.model.eval()
        correct = count = top5 = loss = 0
        with torch.no_grad():
            for i, batch in enumerate(self.val):
                if self.limit and i == 1:
                    break
                logits, y = self.forward(batch)
                correct, count = correct + (logits.argmax(1) == y).sum(), count + len(y)
                if self.save_to:
                    loss = loss + self.loss_fn(logits, y) * len(y)
                    top5 = top5 + (logits.topk(5, 1).indices == y[:, None]).any(1).sum()
        self.val_acc = float(correct) / count  # one host read per epoch
        if self.save_to:
            self.val_loss, self.val_acc5 = float(loss) / count, float(top5) / count
            state = {"model": self.model, "opt": self.opt, "sched": self.sched}
            torch.save({k: v.state_dict() for k, v in state.items()}, self.save_to)
        return now() - t, train


class EpochClock(Callback):
    """Wall time of each epoch of a Lightning run and of its training part (first batch to the last batch's end).
    With a RawLoop, one loop epoch runs at each epoch start: the clock is first in the callback list, so that epoch
    runs before any other hook of the epoch and outside its time. Epoch hooks only, and one compare per step."""

    def __init__(self, raw: RawLoop | None = None) -> None:
        self.raw, self.starts, self.ends, self.train_ends, self.raw_epochs = raw, [], [], [], []

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._close()
        if self.raw is not None:
            self.raw_epochs.append(self.raw.epoch())
        self.starts.append(now())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx + 1 == trainer.num_training_batches:
            self.train_ends.append(now())

    def on_train_end(self, trainer, pl_module) -> None:
        self._close()

    def _close(self) -> None:
        if len(self.ends) < len(self.starts):
            self.ends.append(now())

    def figures(self, steps: int) -> dict:
        run = {"epoch": [b - a for a, b in zip(self.starts, self.ends)], "steps": steps}
        run["train"] = [b - a for a, b in zip(self.starts, self.train_ends)]
        if self.raw is not None:
            assert self.raw.steps == steps, "the two sides must see the same batches"
            run["raw"] = {"epoch": [e for e, _ in self.raw_epochs], "train": [t for _, t in self.raw_epochs]}
        return run


class BenchCLI(ProjectCLI):
    """ProjectCLI with the clock first among the callbacks. Runs whose figures are epochs leave out what lies
    outside every epoch (LogConfig's setup and after-fit work, RunReport's report.png once the clock stopped)."""

    raw: RawLoop | None = None
    whole_fit = False

    def before_fit(self) -> None:
        super().before_fit()
        self.clock = EpochClock(self.raw)
        drop = () if self.whole_fit else ("LogConfig", "RunReport")
        kept = [c for c in self.trainer.callbacks if type(c).__name__ not in drop]
        self.trainer.callbacks = [self.clock, *kept]
        self.fit_start = time.perf_counter()

    def after_fit(self) -> None:  # the test after fit is not run: the fit is what is timed
        self.fit_seconds = now() - self.fit_start


def template_run(
    p: dict, epochs: int, extra: list[str] = (), raw: bool = True, whole_fit: bool = False
) -> dict:
    """The template as `make train` runs it, with a loop epoch before each of its epochs (`raw`)."""
    limit = (
        ["--trainer.limit_train_batches", str(p["limit"]), "--trainer.limit_val_batches", "1"]
        if p["limit"]
        else []
    )
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        args = ["fit", "--run_dir", tmp, "--test_after_fit", str(whole_fit).lower(), *limit, *extra]
        BenchCLI.raw, BenchCLI.whole_fit = RawLoop(epochs, p["limit"]) if raw else None, whole_fit
        argv, sys.argv = sys.argv, sys.argv[:1]  # LightningCLI warns when it sees the bench's own flags
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                cli = build_cli([*args, "--trainer.max_epochs", str(epochs)], cli_class=BenchCLI)
        finally:
            sys.argv = argv
        return {**cli.clock.figures(cli.trainer.num_training_batches), "fit_seconds": cli.fit_seconds}


class StockModule(L.LightningModule):
    """The loop's model, optimizer and schedule, with the template's logged metrics the stock Lightning way: the
    training loss and accuracy from sums kept on the device, logged once an epoch as the template does; torchmetrics
    objects for the validation loss, accuracy, top-5 and best accuracy, handed to self.log."""

    def __init__(self, loop: RawLoop) -> None:
        super().__init__()
        from torchmetrics import MaxMetric, MeanMetric
        from torchmetrics.classification import MulticlassAccuracy

        self.loop, self.model = loop, loop.model
        self.val_loss, self.val_acc_best = MeanMetric(), MaxMetric()
        self.val_acc = MulticlassAccuracy(num_classes=10, average="micro")
        self.val_acc5 = MulticlassAccuracy(num_classes=10, average="micro", top_k=5)
        self.sums, self.steps, self.samples = 0, 0, 0

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        return self.loop.prepare(batch, dataloader_idx)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(x.contiguous(memory_format=torch.channels_last))
        loss = self.loop.loss_fn(logits, y)
        self.sums = self.sums + torch.stack((loss.detach(), (logits.argmax(1) == y).sum().to(loss.dtype)))
        self.steps, self.samples = self.steps + 1, self.samples + len(y)
        return loss

    def on_train_epoch_end(self) -> None:
        self.log("train/loss", self.sums[0] / self.steps)
        self.log("train/acc", self.sums[1] / self.samples)
        self.sums, self.steps, self.samples = 0, 0, 0

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(x.contiguous(memory_format=torch.channels_last))
        self.val_loss.update(self.loop.loss_fn(logits, y), weight=len(y))
        self.val_acc.update(logits, y)
        self.val_acc5.update(logits, y)

    def on_validation_epoch_end(self) -> None:
        self.val_acc_best.update(self.val_acc.compute())
        for name in ("val_loss", "val_acc", "val_acc5", "val_acc_best"):
            self.log(name.replace("val_", "val/").replace("acc5", "acc_top5"), getattr(self, name))

    def configure_optimizers(self):
        return {
            "optimizer": self.loop.opt,
            "lr_scheduler": {"scheduler": self.loop.sched, "interval": "step"},
        }


def stock_run(p: dict, epochs: int) -> dict:
    """Stock Lightning doing the template's job on the loop's model and loaders, a loop epoch before each epoch."""
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    side, clock = RawLoop(epochs, p["limit"]), EpochClock(RawLoop(epochs, p["limit"]))
    with tempfile.TemporaryDirectory(prefix="bench-stock-") as tmp:
        checkpoint = ModelCheckpoint(f"{tmp}/checkpoints", "best-{epoch:03d}", "val/loss", save_last=True)
        trainer = L.Trainer(
            accelerator=DEVICE.type, devices=1, precision=PRECISION, max_epochs=epochs, deterministic=True,
            limit_train_batches=side.steps, limit_val_batches=1 if p["limit"] else None, log_every_n_steps=10,
            logger=[TensorBoardLogger(tmp, "", "", default_hp_metric=False), CSVLogger(tmp, "", "")],
            callbacks=[clock, checkpoint, LearningRateMonitor("epoch")],
            enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        with contextlib.redirect_stdout(io.StringIO()):
            trainer.fit(StockModule(side), side.train, side.val)
    return clock.figures(trainer.num_training_batches)


def whole_fit(p: dict) -> dict:
    """trainer.fit of the template (sanity check, fit_epochs epochs with validation, checkpoints, logging; a test
    to follow, not run) against the loop doing the same work, alternated."""
    template, loop = [], []
    for i in range(max(1, p["default_runs"])):
        for side in ("template", "loop") if i % 2 == 0 else ("loop", "template"):
            if side == "template":
                template.append(template_run(p, p["fit_epochs"], raw=False, whole_fit=True)["fit_seconds"])
                continue
            with tempfile.TemporaryDirectory(prefix="bench-loop-") as tmp:
                raw = RawLoop(p["fit_epochs"], p["limit"], save_to=f"{tmp}/last.pt")
                loop.append(sum(raw.epoch()[0] for _ in range(raw.epochs)))
    ratios = [t / r for t, r in zip(template, loop)]
    return dict(
        epochs=p["fit_epochs"], template_seconds=med(template), loop_seconds=med(loop), ratio=med(ratios)
    )


class FirstStepProbe(Callback):
    """Added to the default run (`--trainer.callbacks+=bench.FirstStepProbe`): the time of its first optimizer step,
    into $BENCH_FIRST_STEP_FILE."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        path = os.environ.get("BENCH_FIRST_STEP_FILE")
        if path and not os.path.exists(path):
            Path(path).write_text(str(time.time()))


def default_runs(p: dict, smoke: bool) -> dict:
    """`make train` as shipped, each in a fresh process, beside a fresh `python -c "import torch, lightning"`."""
    runs = []
    for _ in range(p["default_runs"]):
        t0 = time.time()
        subprocess.run([sys.executable, "-c", "import torch, lightning"], check=True)
        imports = time.time() - t0
        with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
            env = {**os.environ, "BENCH_FIRST_STEP_FILE": f"{tmp}/first_step"}
            env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "scripts"), str(ROOT), env.get("PYTHONPATH", "")])
            cmd = [sys.executable, "-m", "project", "fit", "--config", str(ROOT / "configs/default.yaml")]
            cmd += ["--run_dir", f"{tmp}/run", "--trainer.callbacks+=bench.FirstStepProbe"]
            cmd += ["--config", str(ROOT / "configs/debug/limit_batches.yaml")] * smoke
            with open(f"{tmp}/log.txt", "w") as log:
                start = time.time()
                proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
                _, status, usage = os.wait4(proc.pid, 0)
            if os.waitstatus_to_exitcode(status) != 0:
                raise RuntimeError(f"`{' '.join(cmd)}` failed:\n{Path(tmp, 'log.txt').read_text()[-3000:]}")
            summary = json.loads(Path(tmp, "run", "summary.json").read_text())
            first_step = float(Path(tmp, "first_step").read_text())
            runs.append(dict(train_seconds=summary["train_seconds"], test_acc=summary.get("test_acc"),
                             startup_seconds=round(first_step - start, 3), peak_rss_mb=round(usage.ru_maxrss / 1024, 1),
                             import_torch_lightning_seconds=round(imports, 3)))  # fmt: skip
    return {**{k: med([r[k] for r in runs]) for k in runs[0]}, "runs": runs}


def med(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 4) if xs else None


def iqr(xs: list[float]) -> list[float] | None:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else None
    return q and [round(q[0], 4), round(q[2], 4)]


def ratios(runs: list[dict]) -> list[float]:
    """Loop epoch seconds / the paired epoch's seconds (the same samples): a side's speed relative to the loop."""
    return [r / t for run in runs for r, t in zip(run["raw"]["epoch"][1:], run["epoch"][1:])]


def side_figures(runs: list[dict]) -> dict:
    """A side's figures over its runs' steady epoch pairs: ratio to the loop, overhead per training step (its
    training part minus the loop's, over the steps) and per epoch (the rest: validation, logging, checkpoints,
    epoch hooks, minus the loop's validation), samples/s of the median epoch, and the warm-up epoch."""
    pairs = [(run, e, t, run["raw"]["epoch"][k], run["raw"]["train"][k]) for run in runs for k, (e, t) in
             enumerate(zip(run["epoch"], run["train"])) if k]  # fmt: skip
    samples = runs[0]["steps"] * DEFAULT["data"]["init_args"]["batch_size"]
    return {
        "vs_loop": med(ratios(runs)),
        "vs_loop_iqr": iqr(ratios(runs)),
        "epoch_pairs": len(pairs),
        "per_step_overhead_ms": med([(t - rt) / run["steps"] * 1e3 for run, _, t, _, rt in pairs]),
        "per_epoch_overhead_ms": med([((e - t) - (re - rt)) * 1e3 for _, e, t, re, rt in pairs]),
        "samples_per_s": med([samples / statistics.median(run["epoch"][1:]) for run in runs]),
        "warmup_epoch_seconds": med([run["epoch"][0] for run in runs]),
        "loop_samples_per_s": med([samples / statistics.median(run["raw"]["epoch"][1:]) for run in runs]),
        "loop_step_ms": med([rt / run["steps"] * 1e3 for run, _, _, _, rt in pairs]),
    }


def bench(p: dict, smoke: bool) -> dict:
    warnings.filterwarnings("ignore", message=".*exists and is not empty")  # its two loggers share one folder
    options = {k: v for k, v in OPTIONS.items() if k != "compile" or p["compile"]}
    arms = {
        "template": lambda: template_run(p, p["epochs"]),
        "stock_lightning": lambda: stock_run(p, p["epochs"]),
        **{k: (lambda v=v: template_run(p, p["epochs"], [v])) for k, v in options.items()},
    }
    got: dict[str, list] = {k: [] for k in arms}
    for i in range(p["rounds"]):
        names = [n for n in arms if n in ("template", "stock_lightning") or i < p["option_rounds"]]
        for name in names if i % 2 == 0 else names[::-1]:
            got[name].append(arms[name]())
    template, stock = side_figures(got["template"]), side_figures(got["stock_lightning"])
    res = {"template": template, "stock_lightning": stock, "options": {}}
    res["template_vs_stock_lightning"] = round(template["vs_loop"] / stock["vs_loop"], 4)
    for name in options:
        base = ratios(got["template"][: len(got[name])])
        figures = side_figures(got[name])  # the warm-up epoch holds compile's time
        res["options"][name] = {
            "vs_default": round(statistics.median(ratios(got[name])) / statistics.median(base), 4),
            **{k: figures[k] for k in ("samples_per_s", "warmup_epoch_seconds")},
        }
    res["whole_fit"] = whole_fit(p)
    res["default_run"] = default_runs(p, smoke)
    return res


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:  # the model name `lscpu` shows
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    return {
        "device": torch.cuda.get_device_name(0) if DEVICE.type == "cuda" else f"CPU: {cpu}",
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "precision": PRECISION,
        "torch": torch.__version__,
        "lightning": L.__version__,
        "python": platform.python_version(),
    }


def table(res: dict) -> str:
    t, s, f, d, m = (res[k] for k in ("template", "stock_lightning", "whole_fit", "default_run", "machine"))
    rows = [
        ("**template ÷ stock Lightning**, same settings", f"**{res['template_vs_stock_lightning']}**"),
        (f"template ÷ loop (median of {t['epoch_pairs']} epoch pairs; IQR)", f"{t['vs_loop']}; {t['vs_loop_iqr']}"),
        (f"stock Lightning ÷ loop (median of {s['epoch_pairs']} epoch pairs; IQR)", f"{s['vs_loop']}; {s['vs_loop_iqr']}"),
        (f"overhead over the loop, per step (the loop's step: {t['loop_step_ms']} ms) / per epoch: template; stock",
         f"{t['per_step_overhead_ms']} / {t['per_epoch_overhead_ms']} ms; "
         f"{s['per_step_overhead_ms']} / {s['per_epoch_overhead_ms']} ms"),
        ("samples/s: template / stock Lightning / loop",
         f"{t['samples_per_s']:.0f} / {s['samples_per_s']:.0f} / {t['loop_samples_per_s']:.0f}"),
        ("warm-up epoch s: template / stock Lightning", f"{t['warmup_epoch_seconds']} / {s['warmup_epoch_seconds']}"),
        (f"whole trainer.fit ({f['epochs']} epochs) ÷ the loop doing the same work",
         f"{f['ratio']} ({f['template_seconds']} s vs {f['loop_seconds']} s)"),
        ("`make train`: training s / test acc / command to first step s (`import torch, lightning`) / peak RSS MB",
         f"{d['train_seconds']} / {d['test_acc']} / {d['startup_seconds']} ({d['import_torch_lightning_seconds']})"
         f" / {d['peak_rss_mb']}"),
    ]  # fmt: skip
    rows += [
        (f"option {k}: × default (warm-up epoch s)", f"×{v['vs_default']} ({v['warmup_epoch_seconds']})")
        for k, v in res["options"].items()
    ]
    head = f"`make bench` ({res['profile']}): {m['device']}, {m['cpus']} CPUs, {m['precision']}"
    head += f", torch {m['torch']}, lightning {m['lightning']}"
    return "\n".join([head, "", "| figure | value |", "| --- | --- |", *(f"| {k} | {v} |" for k, v in rows)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="2 rounds, 3 epochs a run")
    g.add_argument(
        "--smoke", action="store_true", help="every key, 1 round of 2 batches: a test, not a measurement"
    )
    ap.add_argument("--out", default="runs/bench/bench.json", help="where the JSON goes")
    args = ap.parse_args()
    profile = "smoke" if args.smoke else "quick" if args.quick else "full"
    started = time.perf_counter()
    res = {"profile": profile, "machine": machine(), **bench(PROFILES[profile], args.smoke)}
    res["bench_seconds"] = round(time.perf_counter() - started, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(table(res))
    print(f"\nwrote {out} in {res['bench_seconds']} s")


if __name__ == "__main__":
    main()

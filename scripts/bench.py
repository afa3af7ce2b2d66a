"""`make bench`: the template against a hand-written PyTorch loop, side by side in one process.

    python scripts/bench.py            # full: 5 runs for the headline ratios, 3 for the rest (sized for <= 10 min)
    python scripts/bench.py --quick    # 2 repeats, fewer sizes (sized for <= 2 min; bench_seconds says how long)
    python scripts/bench.py --smoke    # 1 repeat, 2 batches per epoch, options in 2 runs: every key, no measure
    python scripts/bench.py --gpu      # ResNet-18 on CIFAR-shaped data on CUDA (scripts/bench_gpu.py)

Every figure comes from runs in this invocation, as the median over repeats. The template and the raw loop
alternate epoch by epoch inside each run (bench_loops.EpochClock), and the runs of the options alternate in
ABC...CBA order; ratios are medians of per-epoch pairs, so a machine that slows down hurts both sides alike.
Writes runs/bench/bench.json and prints a markdown table.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# This checkout's `project` (not an installed copy elsewhere), and the bench helpers next to this file.
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]

PROFILES = {  # repeats, epochs per trial (1 warm-up + steady), batch sizes, dataset sizes, default runs
    # The full profile's repeats, from its own noise (the spread of its epoch-pair ratios, docs/performance.md
    # "Performance"): the median of n pairs has a standard error of order sd/sqrt(n). The headline ratios keep 5
    # runs (20 pairs); options, compile and the other batch sizes take 3 (12 pairs), whose standard error stays
    # below the effects of a few percent that an option is kept or dropped for; the default run's figures are a
    # deterministic accuracy and wall times that vary little from run to run (docs/performance-history.md).
    "full": dict(
        repeats=5,
        epochs=5,
        batch_sizes=(32, 64, 128, 256),
        sizes=(1_000, 10_000, 100_000),
        default_runs=3,
        option_repeats=3,
        compile_repeats=3,
        scaling_repeats=3,
        fit_repeats=3,
        limit=None,
        options_in_one_run=False,
        default_args=[],
    ),
    "quick": dict(
        repeats=2,
        epochs=3,
        batch_sizes=(64, 256),
        sizes=(1_000, 100_000),
        default_runs=1,
        option_repeats=1,
        compile_repeats=1,
        scaling_repeats=2,
        fit_repeats=1,
        limit=None,
        options_in_one_run=False,
        default_args=[],
    ),
    "smoke": dict(
        repeats=1,
        epochs=2,
        batch_sizes=(64,),
        sizes=(1_000,),
        default_runs=1,
        option_repeats=1,
        compile_repeats=0,
        scaling_repeats=1,
        fit_repeats=1,
        limit=2,
        options_in_one_run=True,
        default_args=[
            "--trainer.max_epochs",
            "1",
            "--trainer.limit_train_batches",
            "2",
            "--trainer.limit_val_batches",
            "1",
            "--trainer.limit_test_batches",
            "1",
        ],
    ),
}
FIT_EPOCHS = 15  # the default config's max_epochs: the whole `make train` fit
HEADLINE_ARMS = (
    "template",
    "template_vs_tuned_loop",
    "bare_lightning",
    "stock_lightning",
)  # run in every round
VARIANTS = {  # name -> extra CLI args for the template (each compared with the default config, same round)
    "no_progress_bar": ["--trainer.enable_progress_bar", "false"],
    "bf16_mixed": ["--trainer.precision", "bf16-mixed"],
    "contiguous_nchw": ["--model.init_args.channels_last", "false"],
    "accumulate_grad_batches_2": ["--trainer.accumulate_grad_batches", "2"],
    "gradient_clip_val_1": ["--trainer.gradient_clip_val", "1.0"],
    "dataloader_path": ["--data.init_args.in_memory", "false"],
    # Lightning's default profiler (PassThroughProfiler) instead of the config's NoProfiler (project/profiler.py)
    "lightning_profiler": ["--trainer.profiler", "null"],
}


def med(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 4) if xs else None


def pooled(runs: list[dict], figures) -> list[float]:
    """The steady epoch pairs' figures of every run (`figures`: one run's list, e.g. bench_loops.epoch_ratios)."""
    return [x for run in runs for x in figures(run)]


def pooled_overheads(runs: list[dict]) -> tuple[list[float], list[float]]:
    """Per step and per epoch overheads (ms) of every steady epoch pair of `runs` (bench_loops.overheads_ms)."""
    from bench_loops import overheads_ms

    per_run = [overheads_ms(run) for run in runs]
    return [x for steps, _ in per_run for x in steps], [x for _, epochs in per_run for x in epochs]


def ab(run_a, run_b, repeats: int) -> tuple[list, list]:
    """Alternate A and B (ABBA...) `repeats` times; return both result lists."""
    a, b = [], []
    for i in range(repeats):
        if i % 2 == 0:
            a.append(run_a()), b.append(run_b())
        else:
            b.append(run_b()), a.append(run_a())
    return a, b


def bench_cpu(p: dict) -> dict:
    import torch
    from bench_loops import (
        bare_lightning_run,
        epoch_ratios,
        loader_samples_per_s,
        machine,
        steady_samples_per_s,
        stock_lightning_run,
        template_run,
    )

    lim = (
        ["--trainer.limit_train_batches", str(p["limit"]), "--trainer.limit_val_batches", "1"]
        if p["limit"]
        else []
    )
    out: dict = {"machine": machine()}
    E, R = p["epochs"], p["repeats"]
    seeds_loop = {"limit": p["limit"]}  # the loop the seeds show: default AdamW, NCHW
    tuned_loop = {**seeds_loop, "fused": True, "channels_last": True}  # the template's shipped settings

    def tmpl(bs=64, extra=(), raw=seeds_loop, instrument=False, drop=()):
        """A template run with one raw-loop epoch before each of its epochs (bench_loops.EpochClock)."""
        return template_run(E, bs, [*lim, *extra], raw=raw, instrument=instrument, drop=drop, whole_fit=False)

    # One round = the default template, every option, and the default against the tuned raw loop, in an
    # order reversed on odd rounds. Every run carries its own raw-loop epochs, so each figure is a median
    # of per-epoch pairs (template epoch / the raw epoch just before it), and an option's effect is its
    # ratio to the raw loop divided by the default's.
    arms = {
        "template": tmpl,
        "template_vs_tuned_loop": lambda: tmpl(raw=tuned_loop),
        **{k: (lambda extra=v: tmpl(extra=extra)) for k, v in VARIANTS.items()},
        "torch_threads_1": lambda: _threads(1, tmpl),
        # Lightning's loop alone on the tuned loop's work, against the tuned loop: the part of the template's
        # overhead that is Lightning's, whatever the template does.
        "bare_lightning": lambda: bare_lightning_run(E, 64, raw=tuned_loop, limit=p["limit"]),
        # Lightning doing the template's job with its stock parts (ModelCheckpoint best + last, TensorBoard and CSV
        # loggers, LR monitor, the same metrics; no bar): what the template's own code costs is the rest.
        "stock_lightning": lambda: stock_lightning_run(E, 64, raw=tuned_loop, limit=p["limit"]),
    }
    options = [*VARIANTS, "torch_threads_1"]
    if p["options_in_one_run"]:
        # Smoke: every option's flags (and the 1-thread path) in one run, which checks that they
        # still parse and train; each option's key then holds that run (it measures nothing anyway). bf16-mixed
        # runs apart: Lightning's mixed-precision plugin refuses gradient clipping with the fused AdamW.
        every = [a for k, v in VARIANTS.items() if k != "bf16_mixed" for a in v]
        keep = ("template", "template_vs_tuned_loop", "bf16_mixed", "bare_lightning", "stock_lightning")
        arms = {k: arms[k] for k in keep}
        arms["every_option"] = lambda: _threads(1, lambda: tmpl(extra=every))
    got: dict[str, list] = {k: [] for k in arms}
    for i in range(R):
        # The quick profile runs the options in its first round only (bench-quick stays within 2 minutes).
        names = [n for n in arms if i < p["option_repeats"] or n in HEADLINE_ARMS]
        for name in names if i % 2 == 0 else names[::-1]:
            got[name].append(arms[name]())
    t_runs, tuned_runs = got["template"], got["template_vs_tuned_loop"]
    pairs = pooled(t_runs, epoch_ratios)
    step_ms, epoch_ms = pooled_overheads(tuned_runs)
    bare_step_ms, bare_epoch_ms = pooled_overheads(got["bare_lightning"])
    stock_step_ms, stock_epoch_ms = pooled_overheads(got["stock_lightning"])
    cpu_pairs = [
        r / t
        for run in t_runs
        for r, t in zip(run["raw"]["epoch_cpu_seconds"][1:], run["epoch_cpu_seconds"][1:], strict=True)
    ]
    out["throughput"] = {
        "template_samples_per_s": med([steady_samples_per_s(t) for t in t_runs]),
        "raw_loop_samples_per_s": med([steady_samples_per_s(t["raw"]) for t in t_runs]),
        "throughput_ratio": med(pairs),
        "throughput_ratio_iqr": _iqr(pairs),
        "epoch_pairs": len(pairs),
        "run_ratios": [med(epoch_ratios(t)) for t in t_runs],
        "throughput_ratio_cpu_time": med(cpu_pairs),
        "throughput_ratio_vs_tuned_loop": med(pooled(tuned_runs, epoch_ratios)),
        "throughput_ratio_vs_tuned_loop_iqr": _iqr(pooled(tuned_runs, epoch_ratios)),
        # Milliseconds the template adds per training step and per epoch (validation, logging, checkpoints,
        # epoch hooks), against the tuned loop, median over the steady epoch pairs (bench_loops.overheads_ms).
        "per_step_overhead_ms": med(step_ms),
        "per_epoch_overhead_ms": med(epoch_ms),
        "tuned_loop_step_ms": med(
            [r / t["steps_per_epoch"] * 1000 for t in tuned_runs for r in t["raw"]["train_seconds"][1:]]
        ),
        "tuned_loop_epoch_rest_ms": med(
            [
                (e - r) * 1000
                for t in tuned_runs
                for e, r in zip(t["raw"]["epoch_seconds"][1:], t["raw"]["train_seconds"][1:])
            ]
        ),
        "steps_per_epoch": t_runs[0]["steps_per_epoch"],
        # Lightning's loop alone (bench_loops.bare_lightning_run) against the tuned loop: the same figures.
        "bare_lightning_vs_tuned_loop": med(pooled(got["bare_lightning"], epoch_ratios)),
        "bare_lightning_per_step_overhead_ms": med(bare_step_ms),
        "bare_lightning_per_epoch_overhead_ms": med(bare_epoch_ms),
        "stock_lightning_vs_tuned_loop": med(pooled(got["stock_lightning"], epoch_ratios)),
        "stock_lightning_per_step_overhead_ms": med(stock_step_ms),
        "stock_lightning_per_epoch_overhead_ms": med(stock_epoch_ms),
        "template_warmup_epoch_seconds": med([t["epoch_seconds"][0] for t in t_runs]),
        "raw_warmup_epoch_seconds": med([t["raw"]["epoch_seconds"][0] for t in t_runs]),
        "template_steady_epoch_seconds": med([statistics.median(t["epoch_seconds"][1:]) for t in t_runs]),
        "raw_steady_epoch_seconds": med([statistics.median(t["raw"]["epoch_seconds"][1:]) for t in t_runs]),
    }
    out["options"] = {
        name: _paired(
            t_runs[: len(got.get(name, got.get("every_option")))], got.get(name, got.get("every_option"))
        )
        for name in options
    }
    out["options"]["compile"] = _compile(p, tmpl)
    # The template against Lightning's own ceilings, each measured against the same tuned loop: its loop doing the
    # tuned loop's work with no features (bare), and its stock parts doing the template's job (stock); the default
    # (public API only), and with the opt-in door's speed-ups.
    thr = out["throughput"]
    for side in ("bare", "stock"):
        if thr["throughput_ratio_vs_tuned_loop"] and thr[f"{side}_lightning_vs_tuned_loop"]:
            ratio = thr["throughput_ratio_vs_tuned_loop"] / thr[f"{side}_lightning_vs_tuned_loop"]
            thr[f"template_vs_{side}_lightning"] = round(ratio, 3)

    # Data wait: runs of their own, with a per-step timer and a fetch-timing profiler (they cost every step).
    inst = [tmpl(raw=None, instrument=True) for _ in range(max(1, R // 2))]
    out["data_wait_fraction"] = med(
        [t["fetch_seconds"] / max(1e-9, t["fetch_seconds"] + t["step_seconds"]) for t in inst]
    )
    consumed = med([t["samples_per_epoch"] * (E - 1) / max(1e-9, t["step_seconds"]) for t in inst])
    # Checkpoint writes (best and last each epoch: one torch.save + fsync, last.ckpt a hard link to a new best): work
    # the epoch-pair raw loops do not do, inside the template's per-epoch overhead.
    out["checkpoint_ms_per_epoch"] = med([1e3 * t["checkpoint_seconds"] / (E - 1) for t in inst])
    # The progress bar's hooks (per batch and per epoch) timed directly, as a fraction of the steady epochs' wall
    # time (1% is below the run-to-run noise of the option ratios).
    out["progress_bar_hook_fraction"] = med(
        [t["bar_seconds"] / max(1e-9, sum(t["epoch_seconds"][1:])) for t in inst]
    )

    # The whole trainer.fit (sanity check, 15 epochs with validation, checkpoints, logging, report) against a
    # hand-written loop doing the same work (validation loss/acc/top-5 and a checkpoint each epoch), ABBA.
    out["fit"] = _fit(p, lim)

    # Loaders alone, same split and augmentation.
    dl, mem = ab(lambda: loader_samples_per_s(False, 1), lambda: loader_samples_per_s(True, 2), R)
    out["loader"] = {
        "dataloader_samples_per_s": med(dl),
        "in_memory_samples_per_s": med(mem),
        "in_memory_speedup": med([m / d for m, d in zip(mem, dl, strict=True)]),
        "model_consumes_samples_per_s": consumed,
    }

    # Scaling: batch size (template vs raw, interleaved), and the in-memory loader vs dataset size.
    out["scaling"] = {"batch_size": {}, "dataset_size_in_memory_samples_per_s": {}}
    # Against the tuned loop, with the per-step and per-epoch overheads and the training metrics' update cost:
    # what grows with the batch size is work per sample, not loop overhead.
    for bs in p["batch_sizes"]:
        ts = tuned_runs if bs == 64 else [tmpl(bs, raw=tuned_loop) for _ in range(p["scaling_repeats"])]
        ts_step_ms, ts_epoch_ms = pooled_overheads(ts)
        out["scaling"]["batch_size"][str(bs)] = {
            "template_samples_per_s": med([steady_samples_per_s(t) for t in ts]),
            "raw_loop_samples_per_s": med([steady_samples_per_s(t["raw"]) for t in ts]),
            "ratio": med(pooled(ts, epoch_ratios)),
            "tuned_loop_step_ms": med(
                [r / t["steps_per_epoch"] * 1000 for t in ts for r in t["raw"]["train_seconds"][1:]]
            ),
            "per_step_overhead_ms": med(ts_step_ms),
            "per_epoch_overhead_ms": med(ts_epoch_ms),
            "train_metrics_update_ms": _metric_update_ms(bs),
        }
    for n in p["sizes"]:
        out["scaling"]["dataset_size_in_memory_samples_per_s"][str(n)] = med(
            [loader_samples_per_s(True, 1, n=n) for _ in range(R)]
        )
    out["torch_threads"] = torch.get_num_threads()
    return out


def _fit(p: dict, lim: list[str]) -> dict:
    """trainer.fit of the default config (E_FIT epochs, validation each) vs the tuned hand-written loop doing the
    same work, alternated ABBA; the ratio is the median of per-pair ratios. The fit runs as in `make train`, with
    the test to follow it (which draws report.png and logs the HPARAMS record; neither is run nor timed here)."""
    from bench_loops import RawLoop, template_run

    epochs = 2 if p["limit"] else FIT_EPOCHS
    tmpl, raw = [], []

    def run_raw():
        with tempfile.TemporaryDirectory(prefix="bench-raw-") as tmp:
            loop = RawLoop(epochs, limit=p["limit"], fused=True, channels_last=True, save_to=f"{tmp}/last.pt")
            raw.append(loop.fit())

    def run_tmpl():  # as `make train` runs it: a test follows (not run, not timed)
        tmpl.append(template_run(epochs, 64, lim, test_after_fit=True)["fit_seconds"])

    ab(run_tmpl, run_raw, p["fit_repeats"])
    ratios = [t / r for t, r in zip(tmpl, raw, strict=True)]
    return {
        "epochs": epochs,
        "template_fit_seconds": med(tmpl),
        "hand_written_loop_seconds": med(raw),
        "ratio": med(ratios),
    }


def _metric_update_ms(batch_size: int, n: int = 200) -> float:
    """Milliseconds of the template's per-step training metric work (ClassificationModule._add_to_train_sums: the
    loss and the correct predictions added to two sums on the device) on one batch of logits: work the raw loop does
    not do. (It replaced torchmetrics' MeanMetric + MulticlassAccuracy updates per step, many times its cost:
    docs/performance-history.md, round 4.)"""
    import torch

    from project.module import ClassificationModule

    module = ClassificationModule(torch.nn.Identity(), num_classes=10)
    logits, y, loss = torch.randn(batch_size, 10), torch.randint(0, 10, (batch_size,)), torch.tensor(1.0)
    for _ in range(10):
        module._add_to_train_sums(loss, logits, y)
    t = time.perf_counter()
    for _ in range(n):
        module._add_to_train_sums(loss, logits, y)
    return round((time.perf_counter() - t) / n * 1000, 4)


def _iqr(xs: list[float]) -> list[float] | None:
    if len(xs) < 2:
        return None
    q = statistics.quantiles(xs, n=4)
    return [round(q[0], 4), round(q[2], 4)]


def _threads(n: int, fn):
    """Run fn with n intra-op threads. On cores shared with other jobs, OpenMP workers wait for a busy core and
    more threads can run a step many times slower (docs/performance-history.md): worth knowing per machine."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def _paired(base: list, var: list) -> dict:
    """An option against the default: each run's throughput relative to its own interleaved raw-loop epochs,
    option over default (so a machine that is slower during one run does not count as the option's effect)."""
    from bench_loops import epoch_ratios, steady_samples_per_s

    b, v = pooled(base, epoch_ratios), pooled(var, epoch_ratios)
    return {
        "samples_per_s": med([steady_samples_per_s(t) for t in var]),
        "default_samples_per_s": med([steady_samples_per_s(t) for t in base]),
        "ratio_vs_default": round(statistics.median(v) / statistics.median(b), 4) if b and v else None,
        "warmup_epoch_seconds": med([t["epoch_seconds"][0] for t in var]),
    }


def _compile(p: dict, tmpl) -> dict:
    if p["compile_repeats"] == 0:
        return {
            "samples_per_s": None,
            "ratio_vs_default": None,
            "compile_seconds": None,
            "skipped": "smoke profile",
        }
    base, comp = ab(tmpl, lambda: tmpl(extra=["--model.init_args.compile", "true"]), p["compile_repeats"])
    result = _paired(base, comp)
    # Compile happens inside the first epoch: its extra warm-up time over the eager warm-up epoch.
    result["compile_seconds"] = med(
        [c["epoch_seconds"][0] - b["epoch_seconds"][0] for b, c in zip(base, comp, strict=True)]
    )
    result["first_compile_seconds"] = round(comp[0]["epoch_seconds"][0] - base[0]["epoch_seconds"][0], 3)
    return result


def default_runs(p: dict) -> dict:
    """`make train` as shipped, in a fresh process: train seconds, test acc, startup, peak RSS."""
    root = ROOT
    runs = []
    for _ in range(p["default_runs"]):
        # What start-up is compared with, each in a fresh process next to the run: the imports alone, and the
        # CLI's help (imports, the parser's set-up from every class's signature, printing).
        references = {
            "import_torch_lightning_seconds": [sys.executable, "-c", "import torch, lightning"],
            "fit_help_seconds": [sys.executable, "-m", "project", "fit", "--help"],  # the short help
            "fit_help_all_seconds": [sys.executable, "-m", "project", "fit", "--help-all"],  # LightningCLI's
        }
        timed = {}
        for key, ref in references.items():
            t0 = time.time()
            subprocess.run(ref, cwd=root, env=os.environ, stdout=subprocess.DEVNULL, check=True)
            timed[key] = round(time.time() - t0, 3)
        with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
            probe = Path(tmp) / "first_step"
            env = {
                **os.environ,
                "BENCH_FIRST_STEP_FILE": str(probe),
                "PYTHONPATH": os.pathsep.join(
                    [str(root / "scripts"), str(root), os.environ.get("PYTHONPATH", "")]
                ),
            }
            cmd = [
                sys.executable,
                "-m",
                "project",
                "fit",
                "--config",
                str(root / "configs/default.yaml"),
                "--run_dir",
                f"{tmp}/run",
                "--trainer.callbacks+=bench_probe.FirstStepProbe",
                *p["default_args"],
            ]
            with open(Path(tmp) / "log.txt", "w") as log:
                start = time.time()
                proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
                _, status, usage = os.wait4(proc.pid, 0)
                proc.returncode = os.waitstatus_to_exitcode(status)
            if proc.returncode != 0:
                raise RuntimeError(
                    f"`{' '.join(cmd)}` failed:\n{(Path(tmp) / 'log.txt').read_text()[-3000:]}"
                )
            summary = json.loads((Path(tmp) / "run" / "summary.json").read_text())
            marks = json.loads(probe.read_text())  # bench_probe.py: when each part of the start-up ended
            runs.append(
                {
                    "train_seconds": summary["train_seconds"],
                    "test_acc": summary.get("test_acc"),
                    "startup_seconds": round(marks["first_step"] - start, 3),
                    # The start-up's parts, each from the end of the one before: the imports and the parser's
                    # set-up (up to the probe's own import, during parsing), parse + build, setup (loggers,
                    # config.yaml, hparams, model summary), the sanity check + the first step.
                    "startup_parts_seconds": {
                        "imports_and_parser_setup": round(marks["imported"] - start, 3),
                        "parse_and_build": round(marks["setup"] - marks["imported"], 3),
                        "setup": round(marks["sanity_check"] - marks["setup"], 3),
                        "sanity_check_and_first_step": round(marks["first_step"] - marks["sanity_check"], 3),
                    },
                    "dynamo_imported_at_start": marks["dynamo_imported"],
                    **timed,
                    "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
                    "epochs": summary["epochs"],
                }
            )
    keys = ("train_seconds", "test_acc", "startup_seconds", "peak_rss_mb", *references)
    parts = runs[0]["startup_parts_seconds"]
    return {
        **{k: med([r[k] for r in runs]) for k in keys},
        "startup_parts_seconds": {k: med([r["startup_parts_seconds"][k] for r in runs]) for k in parts},
        "dynamo_imported_at_start": all(r["dynamo_imported_at_start"] for r in runs),
        "epochs": runs[0]["epochs"],
        "runs": runs,
        "args": p["default_args"],
    }


def table(res: dict) -> str:
    t, ld, d = res["throughput"], res["loader"], res["default_run"]
    rows = [
        (
            f"throughput_ratio (template / raw loop, median of {t['epoch_pairs']} interleaved epoch pairs, IQR)",
            f"{t['throughput_ratio']} ({t['throughput_ratio_iqr']})",
        ),
        ("throughput_ratio_cpu_time (same, per process CPU second)", t["throughput_ratio_cpu_time"]),
        (
            "throughput_ratio_vs_tuned_loop (raw loop with fused AdamW + channels_last, IQR)",
            f"{t['throughput_ratio_vs_tuned_loop']} ({t['throughput_ratio_vs_tuned_loop_iqr']})",
        ),
        (
            f"overhead vs tuned loop: per step ms (of {t['tuned_loop_step_ms']}) | per epoch ms "
            f"({t['steps_per_epoch']} steps; raw validation {t['tuned_loop_epoch_rest_ms']} ms)",
            f"{t['per_step_overhead_ms']} | {t['per_epoch_overhead_ms']}",
        ),
        ("of the per-epoch overhead: checkpoint writes ms per epoch", res["checkpoint_ms_per_epoch"]),
        (
            "Lightning's loop alone (no logger, checkpoint, bar, metrics) / tuned loop; its overhead per step ms | "
            "per epoch ms",
            f"{t['bare_lightning_vs_tuned_loop']}; {t['bare_lightning_per_step_overhead_ms']} | "
            f"{t['bare_lightning_per_epoch_overhead_ms']}",
        ),
        (
            "template / Lightning's loop alone (its ceiling), from the two ratios to the tuned loop",
            t.get("template_vs_bare_lightning"),
        ),
        (
            "Lightning with the template's settings (stock parts: ModelCheckpoint best + last, TensorBoard + CSV, "
            "LR monitor, the same metrics; no bar) / tuned loop; its overhead per step ms | per epoch ms",
            f"{t['stock_lightning_vs_tuned_loop']}; {t['stock_lightning_per_step_overhead_ms']} | "
            f"{t['stock_lightning_per_epoch_overhead_ms']}",
        ),
        (
            "template / Lightning with the same settings (target >= 0.97)",
            t.get("template_vs_stock_lightning"),
        ),
        (
            f"whole fit ({res['fit']['epochs']} epochs) s: template | hand-written loop, same work | ratio",
            f"{res['fit']['template_fit_seconds']} | {res['fit']['hand_written_loop_seconds']} | "
            f"{res['fit']['ratio']}",
        ),
        ("progress bar: time in its hooks / steady epoch time", res["progress_bar_hook_fraction"]),
        (
            "template samples/s | raw loop samples/s",
            f"{t['template_samples_per_s']:.0f} | {t['raw_loop_samples_per_s']:.0f}",
        ),
        (
            "warm-up epoch s (template | raw)",
            f"{t['template_warmup_epoch_seconds']} | {t['raw_warmup_epoch_seconds']}",
        ),
        ("data_wait_fraction", res["data_wait_fraction"]),
        (
            "loader samples/s (DataLoader | in-memory, speedup)",
            f"{ld['dataloader_samples_per_s']:.0f} | {ld['in_memory_samples_per_s']:.0f} (x{ld['in_memory_speedup']})",
        ),
        ("model consumes samples/s", ld["model_consumes_samples_per_s"]),
        (
            "default run: train s | test acc | startup s | peak RSS MB",
            f"{d['train_seconds']} | {d['test_acc']} | {d['startup_seconds']} | {d['peak_rss_mb']}",
        ),
        (
            "startup s: imports + parser set-up | parse + build | setup | sanity check + first step "
            "(torch._dynamo imported)",
            " | ".join(str(v) for v in d["startup_parts_seconds"].values())
            + f" ({d['dynamo_imported_at_start']})",
        ),
        (
            "startup s (command to first step) | `python -c 'import torch, lightning'` | `python -m project fit "
            "--help` | `--help-all`, fresh processes",
            f"{d['startup_seconds']} | {d['import_torch_lightning_seconds']} | {d['fit_help_seconds']} | "
            f"{d['fit_help_all_seconds']}",
        ),
    ]
    rows += [
        (
            f"batch {bs} vs tuned loop: samples/s template / raw, ratio; overhead ms per step (of step ms) / "
            "per epoch; train metric updates ms",
            f"{v['template_samples_per_s']:.0f} / {v['raw_loop_samples_per_s']:.0f}, {v['ratio']}; "
            f"{v['per_step_overhead_ms']} ({v['tuned_loop_step_ms']}) / {v['per_epoch_overhead_ms']}; "
            f"{v['train_metrics_update_ms']}",
        )
        for bs, v in res["scaling"]["batch_size"].items()
    ]
    rows += [
        (f"in-memory loader, {n} images: samples/s", f"{v:.0f}")
        for n, v in res["scaling"]["dataset_size_in_memory_samples_per_s"].items()
    ]
    for name, v in res["options"].items():
        extra = f", compile {v.get('compile_seconds')} s" if name == "compile" else ""
        rows.append(
            (
                f"option {name}: samples/s (x default)",
                f"{v['samples_per_s']} (x{v['ratio_vs_default']}){extra}",
            )
        )
    m = res["machine"]
    head = f"`make bench` ({res['profile']}), {m['date_utc']} UTC, {m['device']}, {m['cpus']} CPUs, load {m['load_avg_1min_at_start']:.1f}, torch {m['torch']}, lightning {m['lightning']}"
    return "\n".join([head, "", "| figure | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="2 repeats, fewer sizes")
    g.add_argument(
        "--smoke", action="store_true", help="every key, 1 repeat, 2 batches: a test, not a measurement"
    )
    ap.add_argument("--gpu", action="store_true", help="ResNet-18 on CIFAR-shaped synthetic data, CUDA")
    ap.add_argument(
        "--gpu-size", type=int, default=50_000, help="--gpu: synthetic images (tiny values dry-run on CPU)"
    )
    ap.add_argument("--out", default="runs/bench/bench.json", help="where the JSON goes")
    args = ap.parse_args()
    profile = "smoke" if args.smoke else "quick" if args.quick else "full"
    started = time.perf_counter()
    if args.gpu:
        from bench_gpu import bench_gpu

        res = {"profile": profile, **bench_gpu(args.gpu_size, PROFILES[profile]["repeats"])}
    else:
        p = PROFILES[profile]
        res = {"profile": profile, **bench_cpu(p), "default_run": default_runs(p)}
        res["defaults_follow"] = (
            "configs/default.yaml: 32-true, eager (no compile), channels_last, fused AdamW, in-memory loader, "
            "progress bar redrawn at most every 0.5 s: see options.*.ratio_vs_default (an option there is the "
            "change from the default); a default changes only where its ratio is reliably > 1."
        )
    res["bench_seconds"] = round(time.perf_counter() - started, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(res.get("table") or (table(res) if not args.gpu else json.dumps(res, indent=2)))
    print(f"\nwrote {out} in {res['bench_seconds']} s")


if __name__ == "__main__":
    main()

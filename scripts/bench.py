"""`make bench`: the template against a hand-written PyTorch loop, side by side in one process.

    python scripts/bench.py            # full: >= 5 repeats per figure (~6-10 min on 2 CPU cores)
    python scripts/bench.py --quick    # 2 repeats, fewer sizes (~1-2 min)
    python scripts/bench.py --smoke    # 1 repeat, 2 batches per epoch: produces every key, measures nothing
    python scripts/bench.py --gpu      # ResNet-18 on CIFAR-shaped data on CUDA (scripts/bench_gpu.py)

Every figure comes from runs in this invocation, A/B alternated (ABBA order), as the median over repeats;
ratios are medians of per-pair ratios, so a machine that slows down during the bench hurts both sides alike.
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
    "full": dict(
        repeats=5,
        epochs=4,
        batch_sizes=(32, 64, 128, 256),
        sizes=(1_000, 10_000, 100_000),
        default_runs=5,
        compile_repeats=5,
        limit=None,
        default_args=[],
    ),
    "quick": dict(
        repeats=2,
        epochs=3,
        batch_sizes=(32, 64, 256),
        sizes=(1_000, 100_000),
        default_runs=1,
        compile_repeats=1,
        limit=None,
        default_args=[],
    ),
    "smoke": dict(
        repeats=1,
        epochs=2,
        batch_sizes=(64,),
        sizes=(1_000,),
        default_runs=1,
        compile_repeats=0,
        limit=2,
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
VARIANTS = {  # name -> extra CLI args for the template (each compared with the default config, same round)
    "no_progress_bar": ["--trainer.enable_progress_bar", "false"],
    "bf16_mixed": ["--trainer.precision", "bf16-mixed"],
    "channels_last": ["--model.init_args.channels_last", "true"],
    "accumulate_grad_batches_2": ["--trainer.accumulate_grad_batches", "2"],
    "gradient_clip_val_1": ["--trainer.gradient_clip_val", "1.0"],
    "dataloader_path": ["--data.init_args.in_memory", "false"],
}


def med(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 4) if xs else None


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
        loader_samples_per_s,
        machine,
        raw_run,
        steady_cpu_samples_per_s,
        steady_samples_per_s,
        template_run,
    )

    lim = (
        ["--trainer.limit_train_batches", str(p["limit"]), "--trainer.limit_val_batches", "1"]
        if p["limit"]
        else []
    )
    out: dict = {"machine": machine()}
    E, R = p["epochs"], p["repeats"]

    def tmpl(bs=64, extra=()):
        return template_run(E, bs, [*lim, *extra])

    def raw(bs=64):
        return raw_run(E, bs, limit=p["limit"])

    # One round = the default template, the raw loop and every option, in an order reversed on odd rounds
    # (ABC..CBA): each option is compared with the default run of its own round.
    arms = {
        "template": tmpl,
        "raw": raw,
        **{k: (lambda extra=v: tmpl(extra=extra)) for k, v in VARIANTS.items()},
        "torch_threads_1": lambda: _threads(1, tmpl),
    }
    got: dict[str, list] = {k: [] for k in arms}
    for i in range(R):
        for name in list(arms) if i % 2 == 0 else list(arms)[::-1]:
            got[name].append(arms[name]())
    t_runs, r_runs = got["template"], got["raw"]
    ratios = [steady_samples_per_s(t) / steady_samples_per_s(r) for t, r in zip(t_runs, r_runs, strict=True)]
    out["throughput"] = {
        "template_samples_per_s": med([steady_samples_per_s(t) for t in t_runs]),
        "raw_loop_samples_per_s": med([steady_samples_per_s(r) for r in r_runs]),
        "throughput_ratio": med(ratios),
        "ratios": [round(x, 4) for x in ratios],
        "throughput_ratio_cpu_time": med(
            [
                steady_cpu_samples_per_s(t) / steady_cpu_samples_per_s(r)
                for t, r in zip(t_runs, r_runs, strict=True)
            ]
        ),
        "template_warmup_epoch_seconds": med([t["epoch_seconds"][0] for t in t_runs]),
        "raw_warmup_epoch_seconds": med([r["epoch_seconds"][0] for r in r_runs]),
        "template_steady_epoch_seconds": med([statistics.mean(t["epoch_seconds"][1:]) for t in t_runs]),
        "raw_steady_epoch_seconds": med([statistics.mean(r["epoch_seconds"][1:]) for r in r_runs]),
    }
    out["data_wait_fraction"] = med(
        [t["fetch_seconds"] / max(1e-9, t["fetch_seconds"] + t["step_seconds"]) for t in t_runs]
    )
    consumed = med([t["samples_per_epoch"] * (E - 1) / max(1e-9, t["step_seconds"]) for t in t_runs])
    out["options"] = {
        name: _paired(t_runs, got[name], steady_samples_per_s) for name in [*VARIANTS, "torch_threads_1"]
    }
    out["options"]["compile"] = _compile(p, tmpl, steady_samples_per_s)

    # Loaders alone, same split and augmentation.
    dl, mem = ab(lambda: loader_samples_per_s(False, 1), lambda: loader_samples_per_s(True, 2), R)
    out["loader"] = {
        "dataloader_samples_per_s": med(dl),
        "in_memory_samples_per_s": med(mem),
        "in_memory_speedup": med([m / d for m, d in zip(mem, dl, strict=True)]),
        "model_consumes_samples_per_s": consumed,
    }

    # Scaling: batch size (template vs raw), and the in-memory loader vs dataset size.
    out["scaling"] = {"batch_size": {}, "dataset_size_in_memory_samples_per_s": {}}
    for bs in p["batch_sizes"]:
        if bs == 64:
            ts, rs = t_runs, r_runs
        else:
            ts, rs = ab(lambda bs=bs: tmpl(bs), lambda bs=bs: raw(bs), R)
        out["scaling"]["batch_size"][str(bs)] = {
            "template_samples_per_s": med([steady_samples_per_s(t) for t in ts]),
            "raw_loop_samples_per_s": med([steady_samples_per_s(r) for r in rs]),
            "ratio": med(
                [steady_samples_per_s(t) / steady_samples_per_s(r) for t, r in zip(ts, rs, strict=True)]
            ),
        }
    for n in p["sizes"]:
        out["scaling"]["dataset_size_in_memory_samples_per_s"][str(n)] = med(
            [loader_samples_per_s(True, 1, n=n) for _ in range(R)]
        )
    out["torch_threads"] = torch.get_num_threads()
    return out


def _threads(n: int, fn):
    """Run fn with n intra-op threads. On 2 cores shared with other jobs, 2 threads ran the ConvNet step at
    450-1100 ms and 1 thread at ~55 ms (OpenMP workers waiting for a busy core): worth knowing per machine."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def _paired(base: list, var: list, sps) -> dict:
    return {
        "samples_per_s": med([sps(v) for v in var]),
        "default_samples_per_s": med([sps(b) for b in base]),
        "ratio_vs_default": med([sps(v) / sps(b) for b, v in zip(base, var, strict=True)]),
        "warmup_epoch_seconds": med([v["epoch_seconds"][0] for v in var]),
    }


def _compile(p: dict, tmpl, sps) -> dict:
    if p["compile_repeats"] == 0:
        return {
            "samples_per_s": None,
            "ratio_vs_default": None,
            "compile_seconds": None,
            "skipped": "smoke profile",
        }
    base, comp = ab(tmpl, lambda: tmpl(extra=["--model.init_args.compile", "true"]), p["compile_repeats"])
    result = _paired(base, comp, sps)
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
            runs.append(
                {
                    "train_seconds": summary["train_seconds"],
                    "test_acc": summary.get("test_acc"),
                    "startup_seconds": round(float(probe.read_text()) - start, 3),
                    "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
                    "epochs": summary["epochs"],
                }
            )
    keys = ("train_seconds", "test_acc", "startup_seconds", "peak_rss_mb")
    return {
        **{k: med([r[k] for r in runs]) for k in keys},
        "epochs": runs[0]["epochs"],
        "runs": runs,
        "args": p["default_args"],
    }


def table(res: dict) -> str:
    t, ld, d = res["throughput"], res["loader"], res["default_run"]
    rows = [
        ("throughput_ratio (template / raw loop, steady state)", t["throughput_ratio"]),
        ("throughput_ratio_cpu_time (same, per process CPU second)", t["throughput_ratio_cpu_time"]),
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
    ]
    rows += [
        (
            f"batch {bs}: template | raw | ratio",
            f"{v['template_samples_per_s']:.0f} | {v['raw_loop_samples_per_s']:.0f} | {v['ratio']}",
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
            "configs/default.yaml keeps 32-true, eager (no compile), contiguous NCHW on CPU, in-memory loader: "
            "see options.*.ratio_vs_default; a default changes only where its ratio is reliably > 1."
        )
    res["bench_seconds"] = round(time.perf_counter() - started, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(res.get("table") or (table(res) if not args.gpu else json.dumps(res, indent=2)))
    print(f"\nwrote {out} in {res['bench_seconds']} s")


if __name__ == "__main__":
    main()

"""`make bench-data`: the data benchmarks, apart from the training benchmark (`make bench`).

    python scripts/bench_data.py            # full: 5 repeats of each path, 4 epochs each, full decode/folder benches
    python scripts/bench_data.py --quick    # 2 repeats, 3 epochs; the decode and folder benches' quick profiles
    python scripts/bench_data.py --smoke    # every key, 2 batches, tiny decode bench, no folder bench: a test

Three parts, one JSON (runs/bench_data/bench_data.json) and one markdown table:
- decode: scripts/bench_decode.run(quick) (torchvision's reference pipeline vs this template's decode paths).
- folder_setup: scripts/bench_folder_setup.run(quick) (first and second start's data setup on a large folder).
- paths: the default model (configs/default.yaml, trained as `make train` trains it, in this process through
  scripts/bench_loops.template_run) on the same data, the digits' training split, from three data paths:
    in_memory   the default: ImageClassificationDataModule's in-memory loader;
    dataloader  the same module with `--data.init_args.in_memory false` (a DataLoader over the dataset);
    streaming   project.data.StreamingDataModule over that split written by `python -m project prepare --source
                digits` (litdata chunks, read by StreamingDataLoader), augmentation off as in the default config.
  Each path at its own defaults otherwise (loader workers included: the table says how many). Reported: training
  samples/s (steady epochs' training part), whole-epoch samples/s (with validation and checkpoints), and
  data_wait_fraction = time Lightning waits for the next training batch (its `train_dataloader_next`) / (that +
  the training steps), over the steady epochs, as `make bench` defines it. The runs of the three paths alternate
  in ABC, CBA, ... order and every figure is the median over the repeats, so a slow moment of a shared machine
  hits all three. The timers run in every run of every path (they cost each step a little, alike).

The two sub-benchmarks are imported when this runs; a missing one is reported "not available" and the rest runs.
"""

import argparse
import importlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]  # this checkout's project and the bench helpers

OUT = ROOT / "runs" / "bench_data"
PROFILES = {  # repeats per path, epochs per run (the first is warm-up), extra trainer flags
    "full": dict(repeats=5, epochs=4, limit=[]),
    "quick": dict(repeats=2, epochs=3, limit=[]),
    "smoke": dict(
        repeats=1,
        epochs=2,
        limit=["--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1"],
    ),
}
PATHS = ("in_memory", "dataloader", "streaming")
# The streaming path's data wait must stay below this for the default model (issue 12, part 3).
STREAMING_WAIT_TARGET = 0.05


def med(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 4) if xs else None


def sub_bench(module: str, quick: bool, **kwargs) -> dict:
    """`module.run(quick, **kwargs)` from scripts/, or why it did not run."""
    try:
        bench = importlib.import_module(module)
    except ImportError as err:
        return {"available": False, "reason": f"not available: {err}"}
    started = time.perf_counter()
    result = bench.run(quick, **kwargs)
    return {"available": True, **result, "bench_seconds": round(time.perf_counter() - started, 1)}


def prepare_digits(out: Path) -> Path:
    """The digits written as litdata chunks by `python -m project prepare` (kept while complete: re-run safe)."""
    from project.prepare import prepare

    target = out / "digits-stream"
    prepare(source="digits", output_dir=str(target))
    return target


def path_args(name: str, stream_dir: Path) -> list[str]:
    if name == "in_memory":
        return []
    if name == "dataloader":
        return ["--data.init_args.in_memory", "false"]
    return [
        "--data",
        "project.data.StreamingDataModule",
        "--data.init_args.input_dir",
        str(stream_dir),
        "--data.init_args.augment",
        "none",  # as configs/default.yaml sets it for the image module
        "--data.init_args.batch_size",
        "64",
    ]


def one_run(name: str, p: dict, stream_dir: Path) -> dict:
    from bench_loops import template_run

    run = template_run(p["epochs"], 64, [*p["limit"], *path_args(name, stream_dir)], instrument=True)
    steady = slice(1, None)  # the first epoch warms up (worker start, caches, allocator)
    train = sum(run["train_seconds"][steady])
    epochs = len(run["epoch_seconds"][steady])
    return {
        "train_samples_per_s": run["samples_per_epoch"] * epochs / max(1e-9, train),
        "epoch_samples_per_s": run["samples_per_epoch"] / statistics.median(run["epoch_seconds"][steady]),
        "data_wait_fraction": run["fetch_seconds"] / max(1e-9, run["fetch_seconds"] + run["step_seconds"]),
        # the same without each epoch's first fetch (the loader's per-epoch start), which a long epoch amortises
        "data_wait_fraction_after_first_batch": (run["fetch_seconds"] - run["first_fetch_seconds"])
        / max(1e-9, run["fetch_seconds"] - run["first_fetch_seconds"] + run["step_seconds"]),
        # training CPU of this process per sample (epoch CPU x training share of the epoch's wall time)
        "train_cpu_ms_per_sample": sum(
            c * t / max(1e-9, e)
            for c, t, e in zip(
                run["epoch_cpu_seconds"][steady], run["train_seconds"][steady], run["epoch_seconds"][steady]
            )
        )
        / (run["samples_per_epoch"] * epochs)
        * 1000,
        "samples_per_epoch": run["samples_per_epoch"],
        "warmup_epoch_seconds": run["epoch_seconds"][0],
    }


def loader_workers(name: str, stream_dir: Path) -> int:
    """The loader worker processes each path runs with by default (one training process)."""
    from project.data.loaders import default_num_workers

    # The image module's digits are decoded tensors (no files per sample); the streaming module reads files.
    return default_num_workers(reads_files=name == "streaming", local_processes=1)


def streaming_read_cpu_ms(stream_dir: Path, epochs: int, limit: int | None) -> float:
    """CPU milliseconds per sample to read the training split back in this process (StreamingDataLoader, no
    worker, batch 64): what one loader worker spends per sample, whatever else runs on the machine."""
    from litdata import StreamingDataLoader, StreamingDataset

    loader = StreamingDataLoader(
        # batch_decode=1 as StreamingDataModule reads (project/data/streaming.py)
        StreamingDataset(str(stream_dir / "train"), shuffle=True, drop_last=True, batch_decode=1),
        batch_size=64,
        drop_last=True,
    )
    count, cpu = 0, time.process_time()
    for _ in range(epochs):
        for i, batch in enumerate(loader):
            count += len(batch["label"])
            if limit is not None and i + 1 >= limit:
                break
    return (time.process_time() - cpu) / max(1, count) * 1000


def bench_paths(p: dict, out: Path) -> dict:
    stream_dir = prepare_digits(out)
    runs: dict[str, list[dict]] = {name: [] for name in PATHS}
    reads: list[float] = []
    limit = 2 if p["limit"] else None
    for i in range(p["repeats"]):
        for name in PATHS if i % 2 == 0 else PATHS[::-1]:
            runs[name].append(one_run(name, p, stream_dir))
        reads.append(streaming_read_cpu_ms(stream_dir, p["epochs"] - 1, limit))
    result = {}
    for name in PATHS:
        keys = (
            "train_samples_per_s",
            "epoch_samples_per_s",
            "data_wait_fraction",
            "data_wait_fraction_after_first_batch",
            "warmup_epoch_seconds",
        )
        result[name] = {k: med([r[k] for r in runs[name]]) for k in keys}
        result[name]["samples_per_epoch"] = runs[name][0]["samples_per_epoch"]
        result[name]["loader_workers"] = loader_workers(name, stream_dir)
        result[name]["runs"] = len(runs[name])
    base = result["in_memory"]["train_samples_per_s"]
    for name in PATHS:
        result[name]["train_speed_vs_in_memory"] = (
            round(result[name]["train_samples_per_s"] / base, 3) if base else None
        )
    # Load-independent side of the wait: the loader worker's CPU per sample against the training step's (the
    # in-memory path's training CPU per sample). Below 1, one worker with a core of its own keeps up.
    result["streaming_read_cpu_ms_per_sample"] = med(reads)
    result["train_step_cpu_ms_per_sample"] = med([r["train_cpu_ms_per_sample"] for r in runs["in_memory"]])
    result["read_over_step_cpu"] = (
        round(result["streaming_read_cpu_ms_per_sample"] / result["train_step_cpu_ms_per_sample"], 3)
        if result["train_step_cpu_ms_per_sample"]
        else None
    )
    wait = result["streaming"]["data_wait_fraction"]
    result["streaming_data_wait_below_target"] = wait is not None and wait < STREAMING_WAIT_TARGET
    result["streaming_data_wait_target"] = STREAMING_WAIT_TARGET
    result["data"] = (
        f"digits train split ({result['in_memory']['samples_per_epoch']} samples per epoch, batch 64)"
    )
    return result


def table(res: dict) -> str:
    m, paths = res["machine"], res["paths"]
    head = (
        f"`make bench-data` ({res['profile']}), {m['date_utc']} UTC, {m['cpu_model']}, {m['cpus']} CPUs, load "
        f"{m['load_avg_1min_at_start']:.1f}, torch {m['torch']}, lightning {m['lightning']}, litdata {m['litdata']}"
    )
    lines = [head, ""]
    if paths is not None:
        lines += paths_table(paths)
    for name in ("decode", "folder_setup"):
        sub = res[name]
        if not sub.get("available"):
            lines.append(f"{name}: {sub.get('reason', 'skipped')}")
            continue
        shown = {k: v for k, v in sub.items() if k not in ("available", "breakdown_ms_per_sample")}
        lines.append(f"{name}: " + json.dumps(shown)[:2000])
    return "\n".join(lines)


def paths_table(paths: dict) -> list[str]:
    rows = [
        "| path | loader workers | train samples/s (× in-memory) | epoch samples/s | data_wait_fraction "
        "| without each epoch's first batch |"
    ]
    rows.append("|---|---|---|---|---|---|")
    for name in PATHS:
        r = paths[name]
        rows.append(
            f"| {name} | {r['loader_workers']} | {r['train_samples_per_s']:.0f} (×{r['train_speed_vs_in_memory']}) "
            f"| {r['epoch_samples_per_s']:.0f} | {r['data_wait_fraction']:.4f} "
            f"| {r['data_wait_fraction_after_first_batch']:.4f} |"
        )
    target = "met" if paths["streaming_data_wait_below_target"] else "NOT met"
    return [
        *rows,
        "",
        f"streaming data_wait_fraction < {STREAMING_WAIT_TARGET}: {target}",
        f"CPU ms per sample: streaming read (one worker's work) {paths['streaming_read_cpu_ms_per_sample']} vs "
        f"training step {paths['train_step_cpu_ms_per_sample']} (ratio {paths['read_over_step_cpu']})",
        "",
    ]


def machine() -> dict:
    import litdata
    from bench_loops import machine as base

    info = base()
    info["litdata"] = litdata.__version__
    info["cpu_model"] = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return info


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="2 repeats, the sub-benchmarks' quick profiles")
    g.add_argument("--smoke", action="store_true", help="every key, 2 batches: a test, not a measurement")
    ap.add_argument("--out", default=str(OUT / "bench_data.json"), help="where the JSON goes")
    ap.add_argument(
        "--parts",
        default="decode,folder_setup,paths",
        help="comma-separated subset of decode, folder_setup, paths (default: all three)",
    )
    args = ap.parse_args(argv)
    profile = "smoke" if args.smoke else "quick" if args.quick else "full"
    p = PROFILES[profile]
    started = time.perf_counter()
    os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")  # no PyPI request per StreamingDataset
    res: dict = {"profile": profile, "machine": machine()}
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        # --smoke writes its data under a temporary directory (a test must not fill runs/); the others keep it.
        work = Path(tmp) if args.smoke else OUT
        work.mkdir(parents=True, exist_ok=True)
        parts = set(args.parts.split(","))
        skipped = {"available": False, "reason": "skipped (--parts)"}
        res["decode"], res["folder_setup"], res["paths"] = dict(skipped), dict(skipped), None
        if "decode" in parts:
            kwargs = {"n_images": 8, "root": work / "jpeg"} if args.smoke else {}
            res["decode"] = sub_bench("bench_decode", profile != "full", **kwargs)
        if "folder_setup" in parts and args.smoke:
            res["folder_setup"]["reason"] = "skipped by --smoke (it starts two new interpreters)"
        elif "folder_setup" in parts:
            res["folder_setup"] = sub_bench("bench_folder_setup", profile == "quick")
        if "paths" in parts:
            res["paths"] = bench_paths(p, work)
    res["bench_seconds"] = round(time.perf_counter() - started, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(table(res))
    print(f"\nwrote {out} in {res['bench_seconds']} s")
    return res


if __name__ == "__main__":
    main()

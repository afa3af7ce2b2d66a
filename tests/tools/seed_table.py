"""Test accuracy of `make train` on seeds 0-9 under one or more CPU kernel paths: a table with min and mean.

Each seed is `make train ARGS="--seed_everything K"` exactly as a user types it (default config, default thread
count), in its own process with the path's environment variables; the accuracy is the `test_acc` of the
`summary.json` it leaves (the selected checkpoint, tested on the default split). A path is a label and
space-separated VAR=VALUE pairs; before its seeds run, a probe reports the kernels it really gets: oneDNN's ISA
(from ONEDNN_VERBOSE=1 on a convolution of the default model) and ATen's CPU capability.

    .venv/bin/python tests/tools/seed_table.py                        # this machine's default path and SSE4.1 + ATen default
    .venv/bin/python tests/tools/seed_table.py --path "avx2=ONEDNN_MAX_CPU_ISA=AVX2" --seeds 0 1 --json out.json

Each seed is a whole `make train`, imports included; the table is in docs/performance.md. Runs get
OMP_WAIT_POLICY=PASSIVE (--spin leaves it out): idle OpenMP threads sleep instead of spinning, which changes no
arithmetic (same thread count, same split of the work, a bit-identical summary.json) but on shared cores spinning
threads took the cores from the busy ones.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_PATHS = ["default=", "sse41+aten-default=ONEDNN_MAX_CPU_ISA=SSE41 ATEN_CPU_CAPABILITY=default"]

PROBE = """
import torch
from project.models import ConvNet
torch.manual_seed(0)
model = ConvNet(num_classes=10).to(memory_format=torch.channels_last).eval()
with torch.no_grad():
    model(torch.randn(4, 1, 8, 8).contiguous(memory_format=torch.channels_last))
print("aten_capability", torch.backends.cpu.get_cpu_capability(), flush=True)
"""


def parse_path(text: str) -> tuple[str, dict[str, str]]:
    label, _, assignments = text.partition("=")
    env = dict(pair.split("=", 1) for pair in assignments.split())
    return label, env


def probe(env: dict[str, str]) -> dict[str, str]:
    """The kernels a process with this environment really uses."""
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=REPO,
        env={**os.environ, **env, "ONEDNN_VERBOSE": "1"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    isa = re.search(r"onednn_verbose.*?,isa:([^,\n]+)", out)
    convs = re.findall(r"onednn_verbose,.*?exec,cpu,convolution,([^,]+),", out)
    return {
        "onednn_isa": isa.group(1).strip() if isa else "none reported",
        "onednn_conv_impl": " + ".join(sorted(set(convs))) if convs else "no oneDNN convolution",
        "aten_capability": re.search(r"aten_capability (\S+)", out).group(1),
    }


def train(seed: int, env: dict[str, str]) -> dict:
    """`make train ARGS="--seed_everything K"`; returns its summary.json."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("ONEDNN_", "ATEN_CPU", "OMP_", "MKL_"))}
    done = subprocess.run(
        ["make", "train", f"ARGS=--seed_everything {seed}"],
        cwd=REPO,
        env={**clean, **env},
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"make train (seed {seed}) failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    run_dir = re.findall(r"^Run directory: (.+)$", done.stdout, re.MULTILINE)[-1].strip()
    return {"run_dir": run_dir, **json.loads((REPO / run_dir / "summary.json").read_text())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--path",
        action="append",
        help=f'"label=VAR=VALUE VAR=VALUE"; repeatable (default: {" and ".join(DEFAULT_PATHS)})',
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    parser.add_argument("--json", type=Path, help="also write every run's summary here")
    parser.add_argument("--spin", action="store_true", help="leave OpenMP's wait policy at its default")
    opts = parser.parse_args()

    results = {}
    for text in opts.path or DEFAULT_PATHS:
        label, env = parse_path(text)
        kernels = probe(env)
        print(f"[{label}] env {env or '(none)'}: {kernels}", flush=True)
        if not opts.spin:
            env = {"OMP_WAIT_POLICY": "PASSIVE", **env}
        runs, started = [], time.perf_counter()
        for seed in opts.seeds:
            summary = train(seed, env)
            runs.append(summary)
            print(
                f"[{label}] seed {seed}: test_acc {summary['test_acc']:.4f}  best {Path(summary['best_checkpoint']).name}"
                f"  {summary['monitor']} {summary['best_score']:.4f}  best_val_acc {summary['best_val_acc']:.4f}"
                f"  test_loss {summary['test_loss']!r}  train {summary['train_seconds']:.0f} s",
                flush=True,
            )
        wall = time.perf_counter() - started
        results[label] = {"env": env, "kernels": kernels, "runs": runs, "wall_s": round(wall, 1)}

    print(
        f"\n{'path':<20} " + " ".join(f"{s:>6}" for s in opts.seeds) + f" {'min':>6} {'mean':>6} {'wall':>6}"
    )
    for label, r in results.items():
        accs = [run["test_acc"] for run in r["runs"]]
        print(
            f"{label:<20} "
            + " ".join(f"{a:>6.4f}" for a in accs)
            + f" {min(accs):>6.4f} {statistics.fmean(accs):>6.4f} {r['wall_s']:>5.0f}s"
        )
    if opts.json:
        opts.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""The GPU check's stages, started by scripts/gpu_check.sh (which installs the prepared wheels first).

Each stage runs what a user runs (`python3 -m project ...`, `scripts/bench.py`) on this machine's Python and writes
`<out>/<stage>.json` the moment it ends, then `<out>/summary.json`, so a check cut short keeps what finished:
environment (versions; where each wheel's package imports from), doctor, fit (configs/default.yaml, precision left
to the hardware, with gpu_check_probes.Probe: fit_probe.json and sync_debug.json), nondeterministic (an
AdaptiveAvgPool2d model under `deterministic: true` must end in one paragraph naming `--trainer.deterministic
warn`, then train with it, on the GPU only), ddp (configs/ddp.yaml on 1 device), bench (`scripts/bench.py --quick`,
`--smoke` in the dry-run). Exit code 0 when every stage passed.
"""

import argparse
import importlib
import json
import os
import re
import runpy
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

FLOOR = (2, 6)  # pyproject.toml: torch>=2.6 (torch.load before 2.6 is affected by CVE-2025-32434)
WHEEL_PACKAGES = ("jsonargparse", "docstring_parser", "typeshed_client")  # gpu_check.sh's WHEELS
BUDGET_S = 290  # the whole check within 5 minutes on one GPU
# Per-stage caps (s) on the GPU, so a hung stage cannot eat the others' time; each is cut to the budget left.
CAPS = {"doctor": 60, "fit": 120, "nondeterministic": 100, "ddp": 90, "bench": 200}
FIT = [sys.executable, "-m", "project", "fit", "--config", "configs/default.yaml"]


class Check:
    def __init__(self, out: Path, dry_run: bool, budget_s: float) -> None:
        self.out, self.dry_run, self.budget_s = out, dry_run, budget_s
        self.started = time.perf_counter()
        self.stages: list[dict] = []
        self.summary: dict = {"dry_run": dry_run, "out": str(out), "stages": self.stages}
        self.lock = threading.Lock()
        self.forks: threading.Lock | None = None  # set by fork_ready: stages are forks of this process

    def remaining(self) -> float:
        return self.budget_s - (time.perf_counter() - self.started)

    def write(self, name: str, data: dict) -> None:
        tmp = self.out / f"{name}.tmp"
        tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
        tmp.replace(self.out / f"{name}.json")

    def read(self, name: str) -> dict:
        path = self.out / f"{name}.json"
        return json.loads(path.read_text()) if path.is_file() else {}

    def record(self, name: str, result: dict, problems: list[str], file: str | None = None) -> None:
        """The stage's JSON (unless the stage wrote `file` itself), the summary so far, and a line printed."""
        result = {"stage": name, **result, "passed": not problems, "why": "; ".join(problems) or None}
        with self.lock:
            if file is None:
                self.write(name, result)
            entry = {k: result.get(k) for k in ("stage", "passed", "seconds", "why")}
            self.stages.append(entry | {"file": file or f"{name}.json"})
            self.summary["seconds"] = round(time.perf_counter() - self.started, 1)
            self.summary["passed"] = all(s["passed"] for s in self.stages)
            self.write("summary", self.summary)
        verdict = f"FAILED: {result['why']}" if problems else "passed"
        print(f"[gpu_check] {name}: {verdict} ({result.get('seconds') or 0:.1f} s)", flush=True)

    def run(self, name: str, argv: list[str], log: str | None = None, timeout: float | None = None) -> dict:
        """A command from the repository root, logs in <log>.out.log/.err.log, killed with its whole process
        group (DDP ranks included) past the stage's cap or the budget left."""
        cap = self.budget_s if self.dry_run else CAPS[name]  # the dry-run's speed depends on a shared CPU
        timeout = max(1.0, min(cap if timeout is None else timeout, self.remaining()))
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        out_path, err_path = self.out / f"{log or name}.out.log", self.out / f"{log or name}.err.log"
        t0 = time.perf_counter()
        with out_path.open("w") as out, err_path.open("w") as err:
            out.write(f"$ {shlex.join(argv)}\n")
            out.flush()
            if self.forks is not None and argv[0] == sys.executable:
                pid = fork(argv, env, out, err, self.forks)
            else:
                proc = subprocess.Popen(argv, env=env, stdout=out, stderr=err, start_new_session=True)
                pid, proc.returncode = proc.pid, -1  # reaped below, not by Popen
            while not (done := os.wait4(pid, os.WNOHANG))[0] and time.perf_counter() - t0 <= timeout:
                time.sleep(0.1)
            if done[0]:
                rc: int | str = os.waitstatus_to_exitcode(done[1])
            else:
                os.killpg(pid, signal.SIGKILL)
                done, rc = os.wait4(pid, 0), f"killed after {timeout:.0f} s (time limit)"
        return {
            "command": shlex.join(argv),
            "returncode": rc,
            "seconds": round(time.perf_counter() - t0, 1),
            "cpu_seconds": round(done[2].ru_utime + done[2].ru_stime, 1),  # its children's included
            "stdout_tail": out_path.read_text(errors="replace")[-2000:],
            "stderr_tail": err_path.read_text(errors="replace")[-3000:],
            "logs": [out_path.name, err_path.name],
        }

    def overlay(self, name: str, **probe_args) -> str:
        """A config overlay that appends gpu_check_probes.Probe to the callbacks."""
        path, init = self.out / f"{name}.yaml", json.dumps({"out": str(self.out), "name": name, **probe_args})
        path.write_text(
            f"trainer:\n  callbacks+:\n  - class_path: gpu_check_probes.Probe\n    init_args: {init}\n"
        )
        return str(path)

    def sizes(self, epochs: int) -> list[str]:
        """The dry-run's tiny sizes; on the GPU the whole digits set (~20 steps an epoch)."""
        if not self.dry_run:
            return ["--trainer.max_epochs", str(epochs)]
        return (
            "--trainer.max_epochs=1 --trainer.limit_train_batches=6 --trainer.limit_val_batches=2 "
            "--trainer.limit_test_batches=2"
        ).split()


def fork(argv: list[str], env: dict, out, err, lock: threading.Lock) -> int:
    """The dry-run's stand-in for a new interpreter: `python -m X ...` or `python script.py ...` run in a fork of
    this process (torch and lightning already imported), in a session of its own; Check.run waits for it."""
    with lock:  # one fork at a time, from a thread that holds no lock a child could need
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
    if pid:
        return pid
    code = 1  # the child never returns into the check
    try:
        os.setsid()
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (the child's whole life)
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        os.environ.clear()
        os.environ.update(env)
        if argv[1] == "-m":
            sys.argv = [argv[2], *argv[3:]]
            runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv[1:]
            runpy.run_path(argv[1], run_name="__main__")
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
    except BaseException:  # noqa: BLE001 (on the stage's stderr, as a new interpreter would print it)
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001, S110
                pass
        os._exit(code)


def fork_ready(check: Check) -> None:
    """Stages as forks only in the dry-run without CUDA (which must not be initialised before a fork) and on one
    intra-op thread (OpenMP's pool does not survive a fork)."""
    import torch

    if check.dry_run and not torch.cuda.is_available() and torch.get_num_threads() == 1:
        importlib.import_module("project.cli")
        check.forks = threading.Lock()


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v.split("+")[0])[:2])


def environment(check: Check) -> bool:
    t0 = time.perf_counter()
    import torch

    cuda = torch.cuda.is_available()
    info: dict = {
        "python": sys.version.split()[0],
        "python_executable": sys.executable,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": cuda,
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "bf16_supported": torch.cuda.is_bf16_supported() if cuda else None,
        "nccl": torch.cuda.nccl.version() if cuda and torch.distributed.is_nccl_available() else None,
        "packages": {},
        "wheels_installed_into": os.environ.get("GPU_CHECK_SITE") or None,
    }
    for dist in ("lightning", "torchmetrics", "torchvision", "tensorboard", "rich", "wandb"):
        try:
            info["packages"][dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            info["packages"][dist] = None
    problems, site = [], info["wheels_installed_into"]
    for module in WHEEL_PACKAGES:
        try:
            where = info["packages"][module] = str(Path(importlib.import_module(module).__file__).parent)
        except ImportError as err:
            problems.append(f"{module} does not import ({err}): run scripts/gpu_check.sh --prepare")
            continue
        if site and not where.startswith(site):
            problems.append(f"{module} imports from {where}, not from the installed wheels in {site}")
    if _version(torch.__version__) < FLOOR:
        problems.append(f"torch {torch.__version__} is older than the project's floor {FLOOR}")
    if not check.dry_run and not cuda:
        problems.append("no CUDA device visible to torch: on a machine without a GPU use --dry-run")
    if info["packages"]["lightning"] is None:
        problems.append("lightning is not installed")
    print(f"[gpu_check] torch {torch.__version__} (CUDA {torch.version.cuda}), {info['gpu'] or 'no GPU'}")
    check.summary |= {k: info[k] for k in ("torch", "gpu", "bf16_supported", "python")}
    check.record("environment", {**info, "seconds": round(time.perf_counter() - t0, 1)}, problems)
    return not problems


def exit_code(r: dict, expected: int = 0) -> list[str]:
    return [] if r["returncode"] == expected else [f"exit code {r['returncode']}, expected {expected}"]


def doctor(check: Check) -> None:
    r = check.run("doctor", [sys.executable, "-m", "project", "doctor"])
    lines = (r["stdout_tail"] + r["stderr_tail"]).splitlines()
    r["checks"] = [x for x in lines if x.startswith(("ok:", "problem:"))]
    problems = [x for x in r["checks"] if x.startswith("problem:")] or exit_code(r)
    check.record("doctor", r, problems if exit_code(r) else [])


def fit(check: Check) -> None:
    # The window: on the GPU the second epoch (the first autotunes cuDNN); in the dry-run's one epoch, batches 2-4.
    window = dict(
        window_epoch=int(not check.dry_run), window_start=2, window_steps=3 if check.dry_run else 12
    )
    run_dir = check.out / "stage_runs" / "fit"
    overlay = check.overlay("fit_probe", **window)
    r = check.run("fit", [*FIT, "--config", overlay, *check.sizes(3), "--run_dir", str(run_dir)])
    r["probe"] = probe = check.read("fit_probe")
    summary = run_dir / "summary.json"
    r["run_summary"] = json.loads(summary.read_text()) if summary.is_file() else None
    # project/cli.py auto_precision: bf16-mixed on a GPU with bf16, 16-mixed on an older one, 32-true on CPU.
    expected = "bf16-mixed" if check.summary.get("bf16_supported") else "16-mixed"
    expected = "32-true" if check.dry_run else expected
    problems = exit_code(r)
    if probe.get("precision") != expected:
        problems.append(f"precision {probe.get('precision')}, expected {expected} (auto)")
    if not probe.get("batch_on_training_device"):
        problems.append(f"batches on {probe.get('batch_device')}, the model on {probe.get('device')}")
    if not probe.get("train_data_on_device"):
        problems.append("the training split is not held on the training device (the in-memory path)")
    if not check.dry_run and not str(probe.get("device", "")).startswith("cuda"):
        problems.append(f"trained on {probe.get('device')}")
    for key in ("peak_gpu_memory_allocated_mib", "peak_gpu_memory_reserved_mib"):
        check.summary[key] = probe.get(key)
    check.record("fit", r, problems)
    sync = check.read("sync_debug")
    if not sync:
        problems = ["the probe wrote no sync_debug.json (the window never ran)"]
    elif sync.get("canary_caught") is False:
        problems = ["the canary .item() was not caught"]
    else:
        n = sync["syncs_outside_logging_steps"]
        problems = [] if sync["passed"] else [f"{n} host sync(s) in steady-state steps (or an error)"]
    seconds = sync.get("window", {}).get("seconds", 0)
    check.record("sync_debug", {"seconds": seconds}, problems, "sync_debug.json")


def nondeterministic(check: Check) -> None:
    base = [*FIT, "--model.init_args.model", "gpu_check_probes.AdaptivePoolNet", "--trainer.max_epochs=1"]
    base += ["--trainer.limit_train_batches=3", "--trainer.limit_val_batches=1", "--test_after_fit=false"]
    runs = check.out / "stage_runs"
    r = check.run("nondeterministic", [*base, "--run_dir", str(runs / "nondeterministic")])
    err = r["stderr_tail"].strip()
    r["error_paragraph"] = paragraph = err.split("\n\n")[-1] if err else ""
    problems = exit_code(r, 2)
    if "--trainer.deterministic warn" not in paragraph or not paragraph.startswith("error:"):
        problems.append("the last paragraph on stderr is not the error naming --trainer.deterministic warn")
    if "Traceback" in err:
        problems.append("a traceback instead of one paragraph")
    # With the flag it names the run must train. GPU only: on CPU the warn path is torch's Python helper.
    r["with_deterministic_warn"] = "not run in the dry-run"
    left = CAPS["nondeterministic"] - r["seconds"]
    if not check.dry_run and left > 10:
        argv = [*base, "--trainer.deterministic=warn", "--run_dir", str(runs / "nondet_warn")]
        warn = check.run("nondeterministic", argv, log="nondeterministic_warn", timeout=left)
        r["with_deterministic_warn"] = {k: warn[k] for k in ("command", "returncode", "seconds", "logs")}
        problems += [f"with --trainer.deterministic warn: {p}" for p in exit_code(warn)]
        r["seconds"] = round(r["seconds"] + warn["seconds"], 1)
    check.record("nondeterministic", r, problems)


def ddp(check: Check) -> None:
    argv = [*FIT, "--config=configs/ddp.yaml", "--config", check.overlay("ddp_probe"), "--trainer.devices=1"]
    argv += [*check.sizes(2), "--test_after_fit=false", "--run_dir", str(check.out / "stage_runs" / "ddp")]
    r = check.run("ddp", argv)
    r["probe"] = probe = check.read("ddp_probe")
    got = (probe.get("strategy"), probe.get("process_group_backend"))
    expected = "gloo" if check.dry_run else "nccl"
    problems = exit_code(r)
    if got != ("DDPStrategy", expected):
        problems.append(f"{got[0]} on {got[1]}, expected DDPStrategy on {expected}")
    check.record("ddp", r, problems)


def bench(check: Check) -> None:
    out = check.out / "bench_figures.json"  # bench.json is the stage's own record
    size = "--smoke" if check.dry_run else "--quick"
    r = check.run("bench", [sys.executable, "scripts/bench.py", size, "--out", str(out)])
    r["bench"] = res = json.loads(out.read_text()) if out.is_file() and r["returncode"] == 0 else None
    if res:
        check.summary["bench"] = {
            "template_vs_stock_lightning": res["template_vs_stock_lightning"],
            **{f"{k}_samples_per_s": res[k]["samples_per_s"] for k in ("template", "stock_lightning")},
            "loop_samples_per_s": res["template"]["loop_samples_per_s"],
        }
    check.record("bench", r, [] if res else [f"exit code {r['returncode']}, no {out.name}"])


STAGES = {"doctor": doctor, "fit": fit, "nondeterministic": nondeterministic, "ddp": ddp, "bench": bench}


def stage(check: Check, name: str) -> None:
    if check.remaining() < 10:
        check.record(name, {"seconds": 0}, [f"not run: the {check.budget_s:.0f} s budget is spent"])
    else:
        STAGES[name](check)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/gpu_check", help="where the JSON goes")
    ap.add_argument("--dry-run", action="store_true", help="on CPU, tiny sizes, the same stages")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S, help="the whole check's time limit")
    ap.add_argument(
        "--jobs", type=int, default=1, help="stages at once (1: the timings and memory are theirs)"
    )
    args = ap.parse_args()
    out = Path(args.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("*.json"), *out.glob("*.log"), *out.glob("*.yaml")]:
        stale.unlink()
    shutil.rmtree(out / "stage_runs", ignore_errors=True)
    check = Check(out, args.dry_run, args.budget_s)
    if environment(check):
        fork_ready(check)
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            for future in [pool.submit(stage, check, name) for name in STAGES]:
                future.result()
    print(f"[gpu_check] {'passed' if check.summary['passed'] else 'FAILED'}: {out / 'summary.json'}")
    sys.exit(0 if check.summary["passed"] else 1)


if __name__ == "__main__":
    main()

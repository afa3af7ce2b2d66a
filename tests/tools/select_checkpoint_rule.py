"""Which epoch should "the best checkpoint" be? Compare selection rules without the default test split.

The default recipe (configs/default.yaml) is trained on other splits (`--split-seeds`, default 1..5) with a few
training seeds each. After every epoch the weights and that epoch's `val/acc` and `val/loss` are kept; after fit
each epoch's weights are scored on a held-out set: the split's own test portion MINUS every image of the default
(split_seed 0) test split, so no image of the test split that `make train` reports decides the rule. Each rule
picks one epoch from the validation numbers alone and is scored by the held-out accuracy of that epoch.

    OMP_NUM_THREADS=1 .venv/bin/python tests/tools/select_checkpoint_rule.py --seeds 0 1 2 3 --json a.json  # 20 runs
    OMP_NUM_THREADS=1 .venv/bin/python tests/tools/select_checkpoint_rule.py --seeds 4 5 6 7 --json b.json
    .venv/bin/python tests/tools/select_checkpoint_rule.py --load a.json b.json   # the table over both, no training

One thread per run (OMP_NUM_THREADS=1) was the setting measured; the table is in docs/performance.md.

Runs are in-process (one torch/lightning import for all of them) through `project.cli.build_cli(run=False)`,
with the default config as `make train` uses it; only the progress bar and the model summary are off (neither touches
the numbers) and a recording callback is appended after the others.
"""

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.data import DataLoader

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from lightning.pytorch.callbacks import Callback  # noqa: E402

from project.cli import build_cli  # noqa: E402
from project.data import digits  # noqa: E402
from project.data.loaders import TensorImages, batched  # noqa: E402
from project.data.splits import stratified_split  # noqa: E402

# An epoch record: {"epoch", "val_acc", "val_loss", "held_acc"}. A rule returns the index of the chosen record.
Rule = Callable[[list[dict]], int]


def _pick(records: list[dict], key: Callable[[dict], tuple]) -> int:
    """Index of the record with the largest key; on equal keys the first one (max() keeps the first)."""
    return max(range(len(records)), key=lambda i: key(records[i]))


RULES: dict[str, Rule] = {
    # Lightning's ModelCheckpoint(monitor="val/acc", mode="max"): a later epoch must be strictly better.
    "max val/acc, earliest tie": lambda r: _pick(r, lambda e: (e["val_acc"], -e["epoch"])),
    "max val/acc, latest tie": lambda r: _pick(r, lambda e: (e["val_acc"], e["epoch"])),
    "max val/acc, ties by min val/loss": lambda r: _pick(r, lambda e: (e["val_acc"], -e["val_loss"])),
    "min val/loss": lambda r: _pick(r, lambda e: (-e["val_loss"], -e["epoch"])),
    "last epoch": lambda r: len(r) - 1,
}


class EpochRecorder(Callback):
    """Keeps a copy of the weights and the validation metrics after every validation (not the sanity check)."""

    def __init__(self) -> None:
        self.records: list[dict] = []

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        m = trainer.callback_metrics
        self.records.append(
            {
                "epoch": trainer.current_epoch,
                "val_acc": float(m["val/acc"]),
                "val_loss": float(m["val/loss"]),
                "state": copy.deepcopy(pl_module.state_dict()),
            }
        )


def held_out_indices(split_seed: int, test_fraction: float = 0.2) -> tuple[list[int], list[int]]:
    """Positions inside split `split_seed`'s test tensor that are not in the default split's test set, and the
    dataset indices they stand for."""
    _, labels = digits.load_digits_tensors()
    _, default_test = stratified_split(labels, test_fraction, 0)
    _, test = stratified_split(labels, test_fraction, split_seed)
    banned = set(default_test)
    positions = [p for p, i in enumerate(test) if i not in banned]
    return positions, [test[p] for p in positions]


@torch.no_grad()
def accuracy(module, loader, prepare) -> float:
    module.eval()
    correct = total = 0
    for batch in loader:
        _, logits, y = module._shared_step(prepare(batch, 0))
        correct += int((logits.argmax(-1) == y).sum())
        total += y.numel()
    return correct / total


def train_one(split_seed: int, seed: int, extra: list[str], workdir: Path) -> list[dict]:
    args = [
        "--config",
        str(REPO / "configs/default.yaml"),
        "--seed_everything",
        str(seed),
        "--data.init_args.split_seed",
        str(split_seed),
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.enable_model_summary",
        "false",
        "--run_dir",
        str(workdir / f"split{split_seed}-seed{seed}"),
        *extra,
    ]
    cli = build_cli(args, run=False)
    recorder = EpochRecorder()
    cli.trainer.callbacks.append(recorder)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)

    dm = cli.datamodule
    positions, _ = held_out_indices(split_seed, dm.hparams.test_fraction)
    images, labels = dm.tensors["test"]
    pos = torch.tensor(positions)
    loader = DataLoader(TensorImages(images[pos], labels[pos]), 256, collate_fn=batched)
    module = copy.deepcopy(cli.model)
    for record in recorder.records:
        module.load_state_dict(record.pop("state"))
        record["held_acc"] = accuracy(module, loader, dm.on_after_batch_transfer)
    return recorder.records


def score(runs: list[dict]) -> list[dict]:
    rows = []
    for name, rule in RULES.items():
        picked = [run["records"][rule(run["records"])] for run in runs]
        held = [p["held_acc"] for p in picked]
        oracle = [max(e["held_acc"] for e in run["records"]) for run in runs]
        rows.append(
            {
                "rule": name,
                "mean": statistics.fmean(held),
                "worst": min(held),
                "mean_regret": statistics.fmean(o - h for o, h in zip(oracle, held)),
                "mean_epoch": statistics.fmean(p["epoch"] for p in picked),
                "below_0.99": sum(h < 0.99 for h in held),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--split-seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3], help="training seeds per split")
    parser.add_argument("--json", type=Path, help="also write every run's per-epoch records here")
    parser.add_argument(
        "--load",
        type=Path,
        nargs="+",
        help="score the runs stored by earlier --json files instead of training",
    )
    parser.add_argument("extra", nargs="*", help="extra CLI flags for every run, after --")
    opts = parser.parse_args()

    runs, started = [], time.perf_counter()
    if opts.load:
        runs = [run for path in opts.load for run in json.loads(path.read_text())["runs"]]
        opts.split_seeds = sorted({r["split_seed"] for r in runs})
        opts.seeds = sorted({r["seed"] for r in runs})
    with tempfile.TemporaryDirectory() as tmp:
        for split_seed in [] if opts.load else opts.split_seeds:
            for seed in opts.seeds:
                t0 = time.perf_counter()
                records = train_one(split_seed, seed, opts.extra, Path(tmp))
                runs.append({"split_seed": split_seed, "seed": seed, "records": records})
                n = len(held_out_indices(split_seed)[0])
                line = " ".join(f"{e['val_acc']:.3f}/{e['held_acc']:.3f}" for e in records)
                print(
                    f"split {split_seed} seed {seed} ({n} held-out, {time.perf_counter() - t0:.1f} s) "
                    f"val/held per epoch: {line}",
                    flush=True,
                )
    rows = score(runs)
    print(
        f"\n{len(runs)} runs (split seeds {opts.split_seeds} x training seeds {opts.seeds}), "
        + (
            "loaded"
            if opts.load
            else f"{time.perf_counter() - started:.0f} s, torch threads {torch.get_num_threads()}"
        )
    )
    print(
        f"{'rule':<36} {'mean held-out':>13} {'worst':>7} {'mean regret':>11} {'mean epoch':>10} {'runs < 0.99':>11}"
    )
    for r in rows:
        print(
            f"{r['rule']:<36} {r['mean']:>13.4f} {r['worst']:>7.4f} {r['mean_regret']:>11.4f} "
            f"{r['mean_epoch']:>10.1f} {r['below_0.99']:>11d}"
        )
    if opts.json:
        opts.json.write_text(json.dumps({"runs": runs, "rules": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""Replaying a DDP run in one process, and comparing weights bit for bit.

What a 2-rank DDP step computes, with per-rank batches b0 and b1 and the mean loss L of a batch:
    DDP multiplies each rank's gradient by 1/world_size and all-reduces a sum:   g = grad L(b0) * 0.5 + grad L(b1) * 0.5
    one process, accumulate_grad_batches=2 (Lightning backpropagates loss / 2), b0 then b1:
                                                                               g = grad (L(b0) / 2) + grad (L(b1) / 2)
The two are the same floating-point numbers: a factor of 0.5 is exact and commutes with every rounding of the
backward pass (it only shifts exponents), and a sum of two numbers is the same in either order. With the same
batch shapes (so the same kernels), the same thread count and the same optimizer, the weights after any number
of steps are equal bit for bit; any difference is a wrong reduction or a different computation, not noise.

One process fed the concatenated batch (b0 + b1, batch 2B) computes the same gradient in exact arithmetic only:
its kernels sum over 64 samples in another order, so it drifts by rounding. The tests print that figure.
"""

import json
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import torch
import yaml
from torch import Tensor


class ReplayBatches:
    """Batch sampler: epoch e yields `epochs[e]`, a list of index lists. Lightning calls `set_epoch` on
    `batch_sampler.sampler` (here: this object) before each epoch, as it does for a DistributedSampler."""

    def __init__(self, epochs: list[list[list[int]]]) -> None:
        self.epochs, self.epoch, self.sampler = epochs, 0, self

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.epochs[self.epoch])

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.epochs[self.epoch])


def rank_batches(indices: list[int], batch_size: int) -> list[list[int]]:
    return [indices[k : k + batch_size] for k in range(0, len(indices) - batch_size + 1, batch_size)]


def interleaved(ranks: list[list[list[int]]], batch_size: int) -> list[list[list[int]]]:
    """Per epoch: rank 0's batch k, rank 1's batch k, ... (accumulate them: the DDP step k)."""
    epochs = []
    for per_rank in zip(*ranks):
        batches = [rank_batches(idx, batch_size) for idx in per_rank]
        epochs.append([b for step in zip(*batches) for b in step])
    return epochs


def concatenated(ranks: list[list[list[int]]], batch_size: int) -> list[list[list[int]]]:
    """Per epoch: one batch per DDP step, the ranks' batches k joined (batch world_size x B)."""
    epochs = []
    for per_rank in zip(*ranks):
        batches = [rank_batches(idx, batch_size) for idx in per_rank]
        epochs.append([[i for b in step for i in b] for step in zip(*batches)])
    return epochs


def replay(
    module: L.LightningModule,
    x: Tensor,
    y: Tensor,
    epochs: list[list[list[int]]],
    accumulate: int,
    trainer_kwargs: dict | None = None,
    threads: int = 1,
) -> L.Trainer:
    """Train `module` in this process on batches x[idx], y[idx] for the index lists in `epochs`.

    `trainer_kwargs` carries what changes the update (precision, deterministic, gradient clipping), taken from
    the run being replayed. `threads` intra-op threads, as each DDP rank had (kernels split their sums by thread).
    """
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_sampler=ReplayBatches(epochs)
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=len(epochs),
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        **(trainer_kwargs or {}),
    )
    before = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    try:
        trainer.fit(module, train_dataloaders=loader)
    finally:
        torch.set_num_threads(before[0])
        torch.use_deterministic_algorithms(before[1])
    return trainer


def weight_difference(a: dict[str, Tensor], b: dict[str, Tensor]) -> tuple[list[str], float]:
    """(keys whose tensors are not bit-identical, max abs difference over all of them). Same keys required."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    diff = max(((a[k].double() - b[k].double()).abs().max().item() for k in differ), default=0.0)
    return differ, diff


def ranks(probe_dir: Path) -> list[dict]:
    """What tests/ddp_probe.py's SampleProbe recorded on ranks 0 and 1."""
    return [json.loads((probe_dir / f"rank{r}.json").read_text()) for r in range(2)]


def replay_inputs(run_dir: Path) -> tuple[Tensor, Tensor, dict]:
    """The DDP run's training set as its DataLoader path hands it out (a batch = torch.stack of samples, which
    default_collate does, then the data module's per-batch normalisation, elementwise), and the run's trainer
    settings that shape an update (precision, determinism, clipping, accumulation)."""
    from project.data import ImageClassificationDataModule

    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    data = ImageClassificationDataModule(**config["data"]["init_args"])
    data.setup("fit")
    samples = [data.train_set[i] for i in range(len(data.train_set))]
    x, y = torch.stack([s[0] for s in samples]), torch.tensor([s[1] for s in samples])
    x, y = data.on_after_batch_transfer(
        (x, y), 0
    )  # normalised as each batch was (no augmentation in this run)
    keys = (
        "precision",
        "deterministic",
        "gradient_clip_val",
        "gradient_clip_algorithm",
        "accumulate_grad_batches",
    )
    return x, y, {k: config["trainer"][k] for k in keys}


def replay_run(
    run_dir: Path, init: dict, recorded: list, batch_size: int, joined: bool = False
) -> tuple[dict, int]:
    """A 2-rank run of ClassificationModule replayed in one process from rank 0's starting weights `init`, on each
    rank's `recorded` per-epoch indices, one thread as each rank had: (final state_dict, global step). Interleaved
    and accumulated (bit-identical to DDP), or `joined` into one batch per step (equal up to rounding)."""
    from project.module import ClassificationModule

    x, y, trainer_kwargs = replay_inputs(run_dir)
    accumulate = trainer_kwargs.pop("accumulate_grad_batches") or 1
    module = ClassificationModule.load_from_checkpoint(run_dir / "checkpoints" / "last.ckpt")
    module.load_state_dict(init)
    epochs = (concatenated if joined else interleaved)(recorded, batch_size)
    trainer = replay(module, x, y, epochs, accumulate * (1 if joined else 2), trainer_kwargs, threads=1)
    return module.state_dict(), trainer.global_step

"""The DataLoaders of every map-style path: image files, tensors on the host, tensors on the training device.
Exact mid-epoch resume: Lightning saves a training loader's `state_dict()` in every checkpoint and restores it
before the resumed run's first batch, which skips the batches handed out (the ranks move in lockstep)."""

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.utilities.data import suggested_max_num_workers
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from project.errors import ConfigError
from project.rng import mix_seed, run_seed

if TYPE_CHECKING:
    import lightning as L

WORKER_SEED_STREAM = 1  # mix_seed(seed, epoch, 1): worker base seeds; mix_seed(seed, epoch): the order


class TensorImages(Dataset):
    """(N, C, H, W) pixels and labels, on the host or the training device: a batch is one index_select where they
    are, not a collate of samples (its loaders take `collate_fn=batched`)."""

    def __init__(self, images: Tensor, labels: Tensor) -> None:
        self.images, self.labels = images, labels.long()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[Tensor, int]:
        return self.images[i], int(self.labels[i])

    def __getitems__(self, indices: list[int]) -> tuple[Tensor, Tensor]:
        # non_blocking: copying the indices to a GPU must not wait for the queued steps
        i = torch.as_tensor(indices).to(self.labels.device, non_blocking=True)
        return self.images.index_select(0, i), self.labels.index_select(0, i)


def batched(batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    return batch


class EpochShard(DistributedSampler):
    """This rank's equal, contiguous slice of a permutation seeded by mix_seed(seed, epoch) (the remainder is left
    out), started `skip` indices in once. A DistributedSampler, so Lightning keeps it under DDP instead of wrapping
    it; not DistributedSampler's seed + epoch order, which runs seeded s and s + 1 would share an epoch apart."""

    def __init__(self, n: int, seed: int, rank: int = 0, world_size: int = 1) -> None:
        super().__init__(range(n), world_size, rank, shuffle=True, seed=seed, drop_last=True)
        self.skip = 0

    def __iter__(self) -> Iterator[int]:
        skip, self.skip = self.skip, 0
        start = self.rank * self.num_samples
        g = torch.Generator().manual_seed(mix_seed(self.seed, self.epoch))
        order = torch.randperm(len(self.dataset), generator=g)
        return iter(order[start + skip : start + self.num_samples].tolist())


class ResumableDataLoader(DataLoader):
    """Shuffled training loader (drop_last) whose position is saved in and restored from checkpoints. Another
    sampler than an EpochShard (Lightning's, for overfit_batches) cannot skip: a resumed epoch restarts. Worker
    base seeds come from the loader's own generator, re-seeded per epoch, never from the global RNG."""

    def __init__(
        self, dataset: Dataset, batch_size: int, seed: int = 0, sampler: Sampler | None = None, **kwargs: Any
    ) -> None:
        kwargs = {k: v for k, v in kwargs.items() if k not in ("shuffle", "drop_last")}
        kwargs.setdefault("generator", torch.Generator())
        sampler = EpochShard(len(dataset), seed) if sampler is None else sampler
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, drop_last=True, **kwargs)
        self.seed, self.position, self._resume = seed, 0, None

    def __iter__(self) -> Iterator[Any]:
        # A generator: its body runs at the first next(), after Lightning has called set_epoch.
        epoch, state, self._resume = getattr(self.sampler, "epoch", 0), self._resume, None
        skip = state["position"] if state and state["epoch"] == epoch else 0
        if 0 < skip < len(self) and isinstance(self.sampler, EpochShard):
            self.sampler.skip = skip * self.batch_size
        else:
            skip = 0
        self.generator.manual_seed(mix_seed(self.seed, epoch, WORKER_SEED_STREAM))
        self.position = skip  # batches handed out: a checkpoint taken during a step resumes after it
        for batch in super().__iter__():
            self.position += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        state = dict(epoch=getattr(self.sampler, "epoch", 0), position=self.position, seed=self.seed)
        return state | dict(world_size=getattr(self.sampler, "num_replicas", 1), batch_size=self.batch_size)

    def load_state_dict(self, state: dict[str, int]) -> None:
        saved, now = ((s["world_size"], s["batch_size"]) for s in (state, self.state_dict()))
        if saved != now:  # the epoch would be sliced or batched differently
            raise ConfigError(
                f"This checkpoint's loader ran with world_size={saved[0]} and batch_size={saved[1]}, now {now[0]} "
                f"and {now[1]}: the rest of its epoch cannot be reproduced. Resume with the same devices and "
                "--data.init_args.batch_size, or start a new run: --run_dir runs/<new name>."
            )
        self._resume = dict(state)


def default_num_workers(reads_files: bool, local_processes: int = 1) -> int:
    """0 for tensors (a worker would only carry the batches); for files Lightning's suggestion, at most 8."""
    return min(8, suggested_max_num_workers(local_processes)) if reads_files else 0


def loader_args(
    trainer: "L.Trainer | None",
    batch_size: int,
    num_workers: int | None,
    pin_memory: bool | None,
    reads_files: bool,
    collate_fn: Callable | None = None,
) -> dict[str, Any]:
    """The DataLoader arguments every loader shares; pin_memory None: when CUDA is available."""
    if num_workers is None:
        num_workers = default_num_workers(reads_files, trainer.num_devices if trainer is not None else 1)
    return dict(
        batch_size=batch_size,
        num_workers=num_workers,
        pin_memory=pin_memory if pin_memory is not None else torch.cuda.is_available(),
        persistent_workers=num_workers > 0,
        collate_fn=collate_fn,
        generator=torch.Generator(),  # an iterator's base seed, never from the global RNG
    )


def train_loader(dataset: Dataset, trainer: "L.Trainer | None", args: dict[str, Any]) -> ResumableDataLoader:
    """Shuffled, drop_last (equal-size steps keep BatchNorm stable and the DDP ranks in lockstep), resumable."""
    rank, size = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
    sampler = EpochShard(len(dataset), run_seed(), rank, size)
    return ResumableDataLoader(dataset, seed=run_seed(), sampler=sampler, **args)


def eval_loader(dataset: Dataset, trainer: "L.Trainer | None", args: dict[str, Any]) -> DataLoader:
    """In order; under DDP each sample on exactly one rank (DistributedSampler would pad the last shard with
    repeats, counted twice in the metrics)."""
    size = trainer.world_size if trainer is not None else 1
    sampler = (
        UnrepeatedDistributedSampler(dataset, size, trainer.global_rank, shuffle=False) if size > 1 else None
    )
    return DataLoader(dataset, shuffle=False, sampler=sampler, **args)

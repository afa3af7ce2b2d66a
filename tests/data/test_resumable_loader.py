"""The DataLoader path's training loader: its position is saved and a resumed loader continues at that batch."""

import pytest
import torch
from torch.utils.data import TensorDataset

from project.data.epoch_sampler import EpochSampler
from project.data.resumable_loader import ResumableDataLoader


def make_loader(seed: int = 4) -> ResumableDataLoader:
    return ResumableDataLoader(TensorDataset(torch.arange(100)), batch_size=8, seed=seed)


def labels(batches) -> list[list[int]]:
    return [b[0].tolist() for b in batches]


@pytest.mark.claim("resume-bit-identical", "epoch-order-seed-epoch")
def test_a_resumed_loader_continues_at_the_saved_batch():
    original = make_loader()
    original.sampler.set_epoch(1)  # Lightning calls set_epoch before each epoch
    it = iter(original)
    for _ in range(5):
        next(it)
    state = original.state_dict()
    assert state == {"epoch": 1, "batches": 5, "seed": 4}
    rest = labels(it)
    resumed = make_loader()
    resumed.load_state_dict(state)
    resumed.sampler.set_epoch(1)
    assert len(resumed) == len(original) == 12  # drop_last: 100 // 8; the epoch length does not shrink
    assert labels(resumed) == rest and len(rest) == 7  # the same remaining batches, in the same order
    assert resumed.state_dict()["batches"] == 12
    # The next epoch starts from its first batch, with another order.
    resumed.sampler.set_epoch(2)
    again = labels(resumed)
    assert len(again) == 12 and again != labels(make_loader())


def test_a_position_from_another_epoch_or_a_foreign_sampler_restarts_the_epoch():
    loader = make_loader()
    loader.load_state_dict({"epoch": 0, "batches": 5, "seed": 4})
    loader.sampler.set_epoch(1)  # the checkpoint's epoch was 0: this epoch runs whole
    assert len(labels(loader)) == 12
    # Lightning re-creates the loader with its own sampler under DDP: that one cannot skip.
    foreign = ResumableDataLoader(
        TensorDataset(torch.arange(100)), batch_size=8, seed=4, sampler=list(range(100))
    )
    foreign.load_state_dict({"epoch": 0, "batches": 5, "seed": 4})
    assert labels(foreign)[0] == list(range(8))


def test_the_order_is_the_epoch_samplers():
    loader = make_loader(seed=9)
    loader.sampler.set_epoch(3)
    expected = EpochSampler(100, shuffle=True, seed=9).indices(3)[:96].tolist()
    assert sum(labels(loader), []) == expected

"""The DataLoader path's training loader: its position is saved and a resumed loader continues at that batch,
in one process and, with each rank's RankShard, under DDP."""

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.trainer.connectors.data_connector import _DataConnector
from torch.utils.data import TensorDataset

from project.data import ImageClassificationDataModule
from project.data.epoch_sampler import EpochSampler
from project.data.rank_shard import RankShard
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
    assert state == {"epoch": 1, "batches": 5, "seed": 4, "world_size": 1, "batch_size": 8}
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


def image_loader(rank: int, world: int) -> ResumableDataLoader:
    """ImageClassificationDataModule's DataLoader-path training loader, as rank `rank` of `world` builds it."""
    dm = ImageClassificationDataModule(in_memory=False, augment="none", num_workers=0, batch_size=32)
    dm.trainer = SimpleNamespace(
        global_rank=rank, world_size=world, num_devices=world, state=SimpleNamespace()
    )
    dm.setup("fit")
    return dm.train_dataloader()


def lightning_would_wrap(loader) -> bool:
    """Lightning's own test (its DataConnector) for replacing a training loader's sampler under DDP."""
    ddp = SimpleNamespace(
        _accelerator_connector=SimpleNamespace(use_distributed_sampler=True, is_distributed=True)
    )
    return _DataConnector(ddp)._requires_distributed_sampler(loader)


def batches(loader, epoch: int, stop: int | None = None):
    loader.sampler.set_epoch(epoch)  # as Lightning does before each epoch
    out = []
    for batch in loader:
        out.append(batch)
        if len(out) == stop:
            break
    return out


@pytest.mark.claim("ddp-resume-mid-epoch", "ddp-disjoint-shards", "resume-same-world-and-batch-size")
def test_ddp_ranks_resume_mid_epoch_at_their_next_batch():
    # One process: the whole epoch's EpochSampler, as before RankShard existed (Lightning wraps nothing: no DDP).
    assert type(image_loader(0, 1).sampler) is EpochSampler
    # Two ranks: each its RankShard, which Lightning keeps (no DistributedSamplerWrapper, no padding).
    ranks = [image_loader(r, 2) for r in (0, 1)]
    assert all(isinstance(lo.sampler, RankShard) and not lightning_would_wrap(lo) for lo in ranks)
    whole = [batches(lo, epoch=1) for lo in ranks]  # 1,293 training images: 646 a rank, 20 batches of 32
    assert [len(w) for w in whole] == [20, 20]
    # Interrupted after 7 of epoch 1's steps; the checkpoint holds rank 0's position (the ranks step together).
    for lo in ranks:
        batches(lo, epoch=1, stop=7)
    state = ranks[0].state_dict()
    assert state == ranks[1].state_dict()
    assert (state["epoch"], state["batches"], state["world_size"]) == (1, 7, 2)
    # Every rank's new process loads it and continues its own shard at its next batch.
    for r in (0, 1):
        resumed = image_loader(r, 2)
        resumed.load_state_dict(state)
        rest = batches(resumed, epoch=1)
        assert len(rest) == 13 and len(resumed) == 20  # Lightning's epoch length stays the whole epoch's
        for (xa, ya), (xb, yb) in zip(rest, whole[r][7:], strict=True):
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
    # Another world size or batch size would slice the epoch differently: refused, naming the fix.
    with pytest.raises(ValueError, match="world_size=2 .* now 1 .*same devices"):
        image_loader(0, 1).load_state_dict(state)
    with pytest.raises(ValueError, match="batch_size=7"):
        ranks[0].load_state_dict(state | {"batch_size": 7})

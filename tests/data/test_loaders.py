"""The one training loader of every map-style path (files, tensors on the host, tensors on the training device):
its sampler's rank shards, its saved position and a resumed loader continuing at that batch, in one process and
under DDP; the evaluation loaders; the in-memory path's choice."""

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.trainer.connectors.data_connector import _DataConnector

from project.data import ImageClassificationDataModule
from project.data.loaders import EpochShard, ResumableDataLoader, TensorImages, batched
from project.errors import ConfigError


def make_loader(seed: int = 4, n: int = 100) -> ResumableDataLoader:
    images = torch.arange(n, dtype=torch.float32).view(n, 1, 1, 1)
    return ResumableDataLoader(TensorImages(images, torch.arange(n)), 8, seed, collate_fn=batched)


def labels(batches) -> list[list[int]]:
    return [b[1].tolist() for b in batches]


@pytest.mark.parametrize("n, world_size", [(101, 1), (101, 2), (101, 3), (7, 4)])
def test_shards_are_disjoint_equal_and_len_counts_them(n, world_size):
    shards = [list(EpochShard(n, seed=3, rank=r, world_size=world_size)) for r in range(world_size)]
    assert all(
        len(EpochShard(n, 3, r, world_size)) == len(s) == n // world_size for r, s in enumerate(shards)
    )
    every = sum(shards, [])
    assert len(every) == len(set(every))  # disjoint; the remainder of n / world_size is left out this epoch


def test_skip_applies_to_the_next_iteration_only():
    sampler = EpochShard(20, seed=1)
    sampler.set_epoch(2)
    whole = list(sampler)
    sampler.skip = 5
    assert list(sampler) == whole[5:] and list(sampler) == whole and len(sampler) == 20


@pytest.mark.claim("resume-bit-identical", "epoch-order-seed-epoch")
def test_a_resumed_loader_continues_at_the_saved_batch():
    original = make_loader()
    original.sampler.set_epoch(1)  # Lightning calls set_epoch before each epoch
    it = iter(original)
    for _ in range(5):
        next(it)
    state = original.state_dict()
    assert state == {"epoch": 1, "position": 5, "seed": 4, "world_size": 1, "batch_size": 8}
    rest = list(it)
    resumed = make_loader()
    resumed.load_state_dict(state)
    resumed.sampler.set_epoch(1)
    assert len(resumed) == len(original) == 12  # drop_last: 100 // 8; the epoch length does not shrink
    again = list(resumed)
    assert len(again) == len(rest) == 7 and resumed.state_dict()["position"] == 12
    for (xa, ya), (xb, yb) in zip(rest, again, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)  # the same remaining batches, in the same order
    # The next epoch starts from its first batch, with another order; the same for the same (seed, epoch).
    resumed.sampler.set_epoch(2)
    assert len(labels(resumed)) == 12 and labels(resumed) != labels(make_loader())
    assert labels(make_loader(seed=5)) != labels(make_loader()) == labels(make_loader())


def test_a_position_from_another_epoch_or_a_foreign_sampler_restarts_the_epoch():
    loader = make_loader()
    loader.load_state_dict(loader.state_dict() | {"epoch": 0, "position": 5})
    loader.sampler.set_epoch(1)  # the checkpoint's epoch was 0: this epoch runs whole
    assert len(labels(loader)) == 12
    # Lightning re-creates the loader with its own sampler (overfit_batches): that one cannot skip.
    foreign = ResumableDataLoader(
        TensorImages(torch.rand(100, 1), torch.arange(100)), 8, 4, sampler=range(100), collate_fn=batched
    )
    foreign.load_state_dict(foreign.state_dict() | {"epoch": 0, "position": 5})
    assert labels(foreign)[0] == list(range(8))


def test_a_cut_short_epoch_is_followed_by_a_whole_one():
    from lightning.fabric.utilities.data import _set_sampler_epoch

    loader = make_loader(seed=2)
    next(iter(loader))  # limit_train_batches=1: Lightning stops here, then sets the next epoch
    _set_sampler_epoch(loader, 1)
    assert loader.sampler.epoch == 1 and len(labels(loader)) == 12


def image_loader(rank: int, world: int, in_memory: bool, split: str = "train"):
    """ImageClassificationDataModule's loader, as rank `rank` of `world` builds it."""
    dm = ImageClassificationDataModule(in_memory=in_memory, augment="none", num_workers=0, batch_size=32)
    cpu = SimpleNamespace(root_device=torch.device("cpu"))
    dm.trainer = SimpleNamespace(
        global_rank=rank, world_size=world, num_devices=world, state=SimpleNamespace(), strategy=cpu
    )
    dm.setup("fit")
    return getattr(dm, f"{split}_dataloader")()


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
@pytest.mark.parametrize("in_memory", [False, True], ids=["dataloader", "in-memory"])
def test_ddp_ranks_resume_mid_epoch_at_their_next_batch(in_memory):
    # Two ranks: each its EpochShard, which Lightning keeps (no DistributedSamplerWrapper, no padding).
    ranks = [image_loader(r, 2, in_memory) for r in (0, 1)]
    assert all(isinstance(lo.sampler, EpochShard) and not lightning_would_wrap(lo) for lo in ranks)
    whole = [batches(lo, epoch=1) for lo in ranks]  # 1,293 training images: 646 a rank, 20 batches of 32
    assert [len(w) for w in whole] == [20, 20]
    assert not set(ranks[0].sampler) & set(ranks[1].sampler)  # disjoint shards of epoch 1's order
    # Interrupted after 7 of epoch 1's steps; the checkpoint holds rank 0's position (the ranks step together).
    for lo in ranks:
        batches(lo, epoch=1, stop=7)
    state = ranks[0].state_dict()
    assert state == ranks[1].state_dict()
    assert (state["epoch"], state["position"], state["world_size"]) == (1, 7, 2)
    # Every rank's new process loads it and continues its own shard at its next batch.
    for r in (0, 1):
        resumed = image_loader(r, 2, in_memory)
        resumed.load_state_dict(state)
        rest = batches(resumed, epoch=1)
        assert len(rest) == 13 and len(resumed) == 20  # Lightning's epoch length stays the whole epoch's
        for (xa, ya), (xb, yb) in zip(rest, whole[r][7:], strict=True):
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
    # Another world size or batch size would slice the epoch differently: refused, naming the fix.
    with pytest.raises(ConfigError, match="world_size=2 .* now 1 .*same devices.*--run_dir"):
        image_loader(0, 1, in_memory).load_state_dict(state)
    with pytest.raises(ValueError, match="batch_size=7"):
        ranks[0].load_state_dict(state | {"batch_size": 7})


def test_eval_loader_keeps_order_and_the_last_partial_batch():
    loader = image_loader(0, 1, in_memory=True, split="val")  # 144 val images: 4 batches of 32, then 16
    assert [len(y) for _, y in loader] == [32] * 4 + [16] and not loader.drop_last


def test_digits_batches_are_normalised_with_the_training_statistics():
    dm = ImageClassificationDataModule()
    dm.setup("fit")
    assert dm.hparams.in_memory and dm.recipe == "affine"
    x, y = dm.on_after_batch_transfer(next(iter(dm.train_dataloader())), 0)
    assert x.shape == (64, 1, 8, 8) and x.dtype == torch.float32 and y.dtype == torch.int64
    val = torch.cat([dm.on_after_batch_transfer(b, 0)[0] for b in dm.val_dataloader()])
    # Normalised with the training split's statistics: the same two float32 ops (subtract, divide) on the raw
    # val images give the same values up to one rounding each (|z| < 2, so 4 float32 epsilons).
    from project.data.normalize import tensor_stats

    assert (dm.mean, dm.std) == tensor_stats(dm.tensors["train"][0])
    eps = torch.finfo(torch.float32).eps
    assert torch.allclose(val, (dm.tensors["val"][0] - dm.mean[0]) / dm.std[0], rtol=0, atol=4 * eps)


def test_lightning_saves_the_loader_state_in_the_checkpoint(tmp_path):
    import lightning as L

    from project.models import ConvNet
    from project.module import ClassificationModule

    dm = ImageClassificationDataModule()
    module = ClassificationModule(ConvNet(10, width=4), 10, (1, 8, 8))
    trainer = L.Trainer(
        max_steps=3,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, datamodule=dm)
    states = trainer.fit_loop.on_save_checkpoint()["combined_loader"]
    assert states[0]["epoch"] == 0 and states[0]["position"] == 3


@pytest.mark.claim("ddp-shard-set-changes")
def test_each_ranks_set_of_samples_changes_between_epochs():
    """Not only the order: a rank that read the same samples every epoch (a fixed shard, shuffled inside) would
    never see the other ranks' samples."""
    shards = [EpochShard(100, seed=4, rank=r, world_size=2) for r in (0, 1)]
    seen = []
    for epoch in range(3):
        for s in shards:
            s.set_epoch(epoch)
        sets = [set(s) for s in shards]
        assert not sets[0] & sets[1] and len(sets[0]) == len(sets[1]) == 50
        seen.append(sets[0])
    assert seen[0] != seen[1] != seen[2] and seen[0] != seen[2]
    assert len(seen[0] & seen[1]) < 40  # a new draw, not a few samples swapped

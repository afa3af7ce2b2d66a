"""The in-memory batch loader: permutations, rank shards, exact resume, batch augmentation, selection."""

import pytest
import torch

from project.data import ImageClassificationDataModule
from project.data.augment import RECIPES, augment_batch
from project.data.in_memory import InMemoryLoader


def make_loader(n: int = 100, batch_size: int = 8, shuffle: bool = True, **kw) -> InMemoryLoader:
    images = torch.arange(n, dtype=torch.float32).view(n, 1, 1, 1).expand(n, 1, 4, 4).contiguous() / n
    return InMemoryLoader(images, torch.arange(n), batch_size, shuffle=shuffle, **kw)


def epoch_labels(loader) -> list[int]:
    return [int(v) for _, y in loader for v in y]


def test_each_epoch_is_a_new_permutation_without_repeats():
    loader = make_loader(seed=3)
    first, second = epoch_labels(loader), epoch_labels(loader)
    assert len(loader) == 12 and len(first) == len(set(first)) == 96  # drop_last: 100 // 8 batches of 8
    assert first != second and loader.epoch == 1
    assert epoch_labels(make_loader(seed=3)) == first  # the order is a function of (seed, epoch)


def test_eval_loader_keeps_order_and_the_last_partial_batch():
    loader = make_loader(shuffle=False)
    assert len(loader) == 13 and epoch_labels(loader) == list(range(100))


@pytest.mark.parametrize("shuffle", [True, False])
def test_rank_shards_are_disjoint_equal_and_cover_the_split(shuffle):
    shards = [
        epoch_labels(make_loader(n=96, shuffle=shuffle, seed=1, rank=r, world_size=3)) for r in range(3)
    ]
    assert all(len(s) == 32 for s in shards)  # equal batch counts per rank
    union = set().union(*map(set, shards))
    assert sum(map(len, shards)) == len(union) == 96


@pytest.mark.claim("resume-same-world-and-batch-size")
def test_state_dict_round_trip_resumes_the_exact_remaining_batches():
    original = make_loader(seed=5)
    epoch_labels(original)  # finish epoch 0, so the resumed point is inside epoch 1
    it = iter(original)
    for _ in range(4):
        next(it)
    state = original.state_dict()
    assert state["epoch"] == 1 and state["position"] == 4
    rest = list(it)
    resumed = make_loader(seed=0)  # seed comes from the state
    resumed.load_state_dict(state)
    again = list(resumed)
    assert len(again) == len(rest) == 8
    for (xa, ya), (xb, yb) in zip(rest, again, strict=True):
        assert torch.equal(ya, yb) and torch.equal(xa, xb)  # the same samples
    with pytest.raises(ValueError, match="batch_size"):
        make_loader(batch_size=4).load_state_dict(state)
    with pytest.raises(ValueError, match="world_size"):  # another number of processes
        make_loader(rank=0, world_size=2).load_state_dict(state)


def test_lightning_set_epoch_restarts_a_cut_short_epoch():
    from lightning.fabric.utilities.data import _set_sampler_epoch

    loader = make_loader(seed=2)
    it = iter(loader)
    next(it)  # limit_train_batches=1: Lightning stops here, then sets the next epoch
    _set_sampler_epoch(loader, 1)
    assert loader.epoch == 1 and loader.position == 0 and len(epoch_labels(loader)) == 96


@pytest.mark.parametrize("policy", RECIPES)
def test_batch_augmentation_keeps_shape_dtype_and_is_seeded(policy):
    x = torch.rand(16, 3, 8, 8)
    out = augment_batch(x, policy, torch.Generator().manual_seed(0))
    assert out.shape == x.shape and out.dtype == x.dtype
    assert torch.equal(out, augment_batch(x, policy, torch.Generator().manual_seed(0)))
    if policy != "none":
        assert not torch.equal(out, augment_batch(x, policy, torch.Generator().manual_seed(1)))
        assert not torch.equal(out, x)
    if policy == "crop_flip":  # crops and flips move pixels, never invent values
        assert torch.isin(out, x).all()


def test_digits_augmentation_keeps_digits_recognisable():
    dm = ImageClassificationDataModule(augment="affine")
    dm.setup("fit")
    x, y = dm.tensors["train"]
    x, y = x[:256], y[:256]
    out = augment_batch(x, "affine", torch.Generator().manual_seed(0))
    # Changed: every image moved (rotation, scale and shift are drawn from continuous ranges: the identity has
    # probability 0; grid_sample at an identity grid would return the image itself).
    assert (out != x).flatten(1).any(1).all()
    # Still the same digit: each augmented image is on average closer to its original (cosine ~0.87) than two
    # originals of different classes are to each other (~0.68, measured here on the same 256 images); a shift of a
    # whole pixel, past the 10% (0.8 px) range, already brings it down to ~0.67.
    corr = torch.nn.functional.cosine_similarity(out.flatten(1), x.flatten(1))
    unit = torch.nn.functional.normalize(x.flatten(1), dim=1)
    other_class = unit @ unit.T
    assert corr.mean() > other_class[y[:, None] != y[None, :]].mean()


def test_data_module_picks_the_in_memory_path_for_digits_and_can_be_forced_off():
    dm = ImageClassificationDataModule()
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert isinstance(loader, InMemoryLoader) and dm.recipe == "affine"
    x, y = dm.on_after_batch_transfer(next(iter(loader)), 0)
    assert x.shape == (64, 1, 8, 8) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert isinstance(dm.val_dataloader(), InMemoryLoader)
    val = torch.cat([dm.on_after_batch_transfer(b, 0)[0] for b in dm.val_dataloader()])
    # Normalised with the training split's statistics: the same two float32 ops (subtract, divide) on the raw
    # val images give the same values up to one rounding each (|z| < 2, so 4 float32 epsilons).
    from project.data.stats import tensor_stats

    assert (dm.mean, dm.std) == tensor_stats(dm.tensors["train"][0])
    raw_val = dm.tensors["val"][0]
    eps = torch.finfo(torch.float32).eps
    assert torch.allclose(val, (raw_val - dm.mean[0]) / dm.std[0], rtol=0, atol=4 * eps)
    off = ImageClassificationDataModule(in_memory=False)
    off.setup("fit")
    assert isinstance(off.train_dataloader(), torch.utils.data.DataLoader)


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

"""EpochSampler, the one sampler of both training paths: rank shards, lengths, and a one-time skip."""

import pytest

from project.data.epoch_sampler import EpochSampler


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("n, world_size", [(101, 1), (101, 2), (101, 3), (7, 4)])
def test_shards_are_disjoint_and_len_counts_them(shuffle, n, world_size):
    shards = [
        list(EpochSampler(n, shuffle, seed=3, rank=r, world_size=world_size)) for r in range(world_size)
    ]
    for r, shard in enumerate(shards):
        assert len(EpochSampler(n, shuffle, seed=3, rank=r, world_size=world_size)) == len(shard)
    every = sum(shards, [])
    assert len(every) == len(set(every))  # disjoint
    if shuffle:  # equal shards: the remainder of n / world_size is left out this epoch
        assert {len(s) for s in shards} == {n // world_size}
    else:  # evaluation: every sample exactly once
        assert sorted(every) == list(range(n))


def test_skip_applies_to_the_next_iteration_only():
    sampler = EpochSampler(20, seed=1)
    sampler.set_epoch(2)
    whole = list(sampler)
    sampler.skip = 5
    assert list(sampler) == whole[5:] and list(sampler) == whole and len(sampler) == 20

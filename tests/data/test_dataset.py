"""Split items and the seeded training order (the DataModules' use of them: test_datamodule.py)."""
from __future__ import annotations

from graphormer_urpe.data.dataset import SeededShuffleSampler


def test_sampler_is_a_permutation_of_seed_and_epoch():
    sampler = SeededShuffleSampler(100, seed=3)
    first = list(sampler)
    assert sorted(first) == list(range(100)) and list(sampler) == first
    sampler.set_epoch(1)
    assert list(sampler) != first
    assert list(SeededShuffleSampler(100, seed=4)) != first


def test_sampler_resumed_inside_an_epoch_yields_the_rest_of_its_order():
    done = [0]
    sampler = SeededShuffleSampler(100, seed=3, batch_size=16, batches_done=lambda: done[0])
    sampler.set_epoch(2)
    whole = list(sampler)
    done[0] = 3
    assert list(sampler) == whole[48:] and len(sampler) == 100

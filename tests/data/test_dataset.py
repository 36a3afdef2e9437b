"""Split items and the seeded training order (the DataModules' use of them: test_datamodule.py)."""
from __future__ import annotations

import numpy as np
import pytest

from graphormer_urpe.data import ZINCDataModule
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
def test_bucketed_sampler_serves_every_item_once_in_batches_of_similar_size(zinc_data_root):
    dm = ZINCDataModule(root=str(zinc_data_root), batch_size=64, bucket_batches=16)
    dm.setup("fit")
    sizes = dm.splits["train"].num_nodes
    loader = dm.train_dataloader()
    sampler = loader.sampler
    sampler.set_epoch(1)
    order = np.asarray(list(sampler))
    assert sorted(order.tolist()) == list(range(len(sizes)))
    full = len(order) // 64
    batches = order[:full * 64].reshape(full, 64)
    # Each batch is a run of one size-sorted window, so its largest graph is close to its mean
    # and padding wastes far less than with a plain shuffle of the same items.
    plain = np.random.default_rng(0).permutation(len(sizes))[:full * 64].reshape(full, 64)
    padded_pairs = (sizes[batches].max(1) ** 2).sum()
    assert padded_pairs < 0.6 * (sizes[plain].max(1) ** 2).sum()
    assert np.all(np.diff(sizes[batches], axis=1) >= 0)  # sorted inside each batch
    # The batches are shuffled across windows, the order is a function of (seed, epoch) only,
    # and a resumed epoch continues it.
    assert not np.all(np.diff(sizes[batches[:, 0]]) >= 0)
    again = SeededShuffleSampler(len(sizes), seed=dm.seed, batch_size=64, sizes=sizes, bucket_batches=16)
    again.set_epoch(1)
    np.testing.assert_array_equal(list(again), order)
    again.batches_done = lambda: 5
    np.testing.assert_array_equal(list(again), order[5 * 64:])
    # The DataLoader cuts the same batches (the incomplete one last).
    sampler.set_epoch(1)
    served = [batch.index.numpy() for batch in loader]
    np.testing.assert_array_equal(served[3], batches[3])
    assert len(served[-1]) == len(order) - full * 64


def test_bucketing_needs_item_sizes(tmp_path):
    # A DataModule refuses a negative window when it is built, before any data work.
    with pytest.raises(ValueError, match="bucket_batches must be >= 0"):
        ZINCDataModule(root=str(tmp_path), bucket_batches=-2)
    with pytest.raises(ValueError, match="size of each of the 10 items"):
        SeededShuffleSampler(10, batch_size=2, bucket_batches=4)
    with pytest.raises(ValueError, match="bucket_batches must be >= 0"):
        SeededShuffleSampler(10, batch_size=2, sizes=np.ones(10), bucket_batches=-1)


def test_bucketed_shares_of_processes_make_the_global_batches_of_one_process():
    """With bucketing, 2 processes at 8 serve in their k-th batches together exactly the k-th
    batch of one process at 16 (size-sorted runs of global batches, then shared)."""
    sizes = np.random.default_rng(0).integers(5, 40, 200)
    one = SeededShuffleSampler(200, seed=1, batch_size=16, sizes=sizes, bucket_batches=4)
    ranks = [SeededShuffleSampler(200, seed=1, batch_size=8, sizes=sizes, bucket_batches=4, num_replicas=2, rank=r)
             for r in range(2)]
    whole, shares = one.permutation(), [r.shard() for r in ranks]
    for k in range(200 // 16):
        served = np.concatenate([share[8 * k:8 * (k + 1)] for share in shares])
        assert sorted(served.tolist()) == sorted(whole[16 * k:16 * (k + 1)].tolist()), k

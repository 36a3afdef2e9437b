"""Device-resident data: the torch gather equals the numpy collation, and resident loaders serve
exactly the DataLoader's batches (same items, order, padding, dtypes) on real ZINC and PCQM4Mv2."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from graphormer_urpe.data.batch import GraphBatch
from graphormer_urpe.data.batch import collate
from graphormer_urpe.data import PCQM4Mv2DataModule, ZINCDataModule
from graphormer_urpe.data.dataset import SeededShuffleSampler
from graphormer_urpe.data.ogb_lsc import PCQM4MV2, write_root
from graphormer_urpe.data.batch import gather_batch
from graphormer_urpe.data.resident import ResidentLoader, ResidentSplit
from graphormer_urpe.data.batch import BatchPadding


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def assert_same_batch(expected: GraphBatch, actual: GraphBatch) -> None:
    tensors = expected.tensors()
    assert list(tensors) == list(actual.tensors())  # the same fields and encodings
    for name, a in tensors.items():
        b = actual.tensors()[name]
        assert a.dtype == b.dtype, f"{name}: {a.dtype} != {b.dtype}"
        if a.dtype == torch.float32:  # bit patterns: NaN targets (unlabelled rows) compare equal
            a, b = a.view(torch.int32), b.view(torch.int32)
        assert torch.equal(a, b), name


def assert_same_loaders(expected, actual) -> int:
    """Every batch equal, bit for bit; returns the number of batches."""
    assert len(expected) == len(actual)
    count = 0
    for a, b in zip(expected, actual, strict=True):
        assert_same_batch(a, b)
        count += 1
    return count


def test_gather_batch_equals_numpy_collate_on_real_zinc(zinc_data_root):
    dm = ZINCDataModule(root=str(zinc_data_root))
    graphs = dm.train_dataset().graphs
    on_cpu = graphs.to("cpu")
    rng = np.random.default_rng(0)
    for size in (1, 7, 128, 300):
        index = rng.integers(0, len(graphs), size)  # any order, repeats allowed
        expected = collate(graphs, index)
        assert_same_batch(expected, gather_batch(on_cpu, torch.from_numpy(index)))
        n, m = np.diff(graphs.node_ptr)[index], np.diff(graphs.edge_ptr)[index]
        exact = BatchPadding(int(n.max()), int(m.sum()))  # sized from host-side counts: no sync
        assert_same_batch(expected, gather_batch(on_cpu, torch.from_numpy(index), padding=exact,
                                                 check_padding=False))
    # overridden targets and positions (rows sharing a stored graph)
    index = np.array([5, 5, 9000, 17])
    y = rng.normal(size=(4, 1)).astype(np.float32)
    positions = np.array([3, 2, 1, 0])
    gathered = gather_batch(on_cpu, torch.from_numpy(index), torch.from_numpy(y), torch.from_numpy(positions))
    assert_same_batch(collate(graphs, index, y, positions), gathered)


def test_fixed_shape_gather_equals_the_padded_collation_on_real_zinc(zinc_data_root):
    """gather_batch into a fixed padding (every intermediate of a fixed shape, for CUDA graphs;
    checked or not) gives the padded numpy collation bit for bit: random batches, repeats, the
    largest graphs, overrides."""
    dm = ZINCDataModule(root=str(zinc_data_root))
    graphs = dm.train_dataset().graphs
    on_cpu = graphs.to("cpu")
    n, m = np.diff(graphs.node_ptr), np.diff(graphs.edge_ptr)
    rng = np.random.default_rng(1)
    for size in (1, 16, 64):
        padding = BatchPadding.covering(n, m, size)
        largest = np.argsort(-m, kind="stable")[:size]  # the batch that fills every edge row
        for index in (rng.integers(0, len(graphs), size), largest):
            expected = collate(graphs, index, padding=padding)
            for check in (True, False):
                assert_same_batch(expected, gather_batch(on_cpu, torch.from_numpy(index), padding=padding,
                                                         check_padding=check))
    index = np.array([5, 5, 9000, 17])
    y = rng.normal(size=(4, 1)).astype(np.float32)
    positions = np.array([3, 2, 1, 0])
    padding = BatchPadding.covering(n, m, 4)
    gathered = gather_batch(on_cpu, torch.from_numpy(index), torch.from_numpy(y), torch.from_numpy(positions),
                            padding=padding, check_padding=False)
    assert_same_batch(collate(graphs, index, y, positions, padding), gathered)


def test_gather_batch_rejects_sizes_of_another_batch(zinc_data_root):
    """Sizes of two graphs given for a batch of three: refused in one line, not a garbled batch."""
    graphs = ZINCDataModule(root=str(zinc_data_root)).train_dataset().graphs.to("cpu")
    n, m = np.diff(graphs.node_ptr.numpy())[:2], np.diff(graphs.edge_ptr.numpy())[:2]
    with pytest.raises(ValueError, match="a batch of 3 graphs .* does not fit the padding"):
        gather_batch(graphs, torch.tensor([0, 1, 2]), padding=BatchPadding(int(n.max()), int(m.sum())))


def test_resident_loaders_serve_the_dataloader_batches(zinc_data_root, caplog):
    def module(resident: bool) -> ZINCDataModule:
        dm = ZINCDataModule(root=str(zinc_data_root), batch_size=500, eval_batch_size=300, seed=4,
                            max_nodes=30, device_resident=resident)
        dm.setup("fit")
        dm.setup("test")
        return dm

    loaders, resident = module(False), module(True)
    train, resident_train = loaders.train_dataloader(), resident.train_dataloader()
    assert isinstance(resident_train, ResidentLoader) and resident_train.split.device == torch.device("cpu")
    dropped = int((loaders.splits["train"].num_nodes > 30).sum())
    assert dropped > 0 and len(resident_train.split) == 10_000 - dropped  # max_nodes drops the same graphs
    for epoch in (0, 3):  # the order is (seed, epoch), set through the sampler as Lightning does
        train.sampler.set_epoch(epoch)
        resident_train.sampler.set_epoch(epoch)
        batches = assert_same_loaders(train, resident_train)
        assert batches == len(train) == math.ceil(len(resident_train.split) / 500)
    assert assert_same_loaders(loaders.val_dataloader(), resident.val_dataloader()) == 4
    assert assert_same_loaders(loaders.test_dataloader(), resident.test_dataloader()) == 4
    # one device copy per store, however often Lightning asks for loaders
    resident.train_dataloader()
    assert len(resident._resident_graphs) == 3


def test_resident_pcqm4mv2_rows_sharing_molecules(pcqm_source, tmp_path):
    """PCQM4Mv2 stores each distinct molecule once; rows (with their own targets and positions)
    point into the store. 2,400 training rows cycle through 1,999 molecules."""
    write_root(tmp_path, pcqm_source, PCQM4MV2,
               split_sizes={"train": 2400, "valid": 200, "test-dev": 50, "test-challenge": 50})
    loaders, resident = (PCQM4Mv2DataModule(root=str(tmp_path), batch_size=256, eval_batch_size=64,
                                            device_resident=flag) for flag in (False, True))
    for dm in (loaders, resident):
        dm.setup("fit")
        dm.setup("predict")
    train = loaders.splits["train"]
    assert len(np.unique(train.graph_ids)) < len(train)
    assert assert_same_loaders(loaders.train_dataloader(), resident.train_dataloader()) == 10
    assert assert_same_loaders(loaders.predict_dataloader(), resident.predict_dataloader()) == 1
    assert len(resident._resident_graphs) == 1  # all splits share the one store


def test_ranks_share_the_epoch_order_and_top_up_with_unlabelled_items(zinc_data_root):
    """3 processes over the 1,000 validation graphs at 64 each: rank r serves items r, r + 3, ...
    of the epoch's order, the 2 items that top up the shares of ranks 1 and 2 come without labels
    (position -1), and the k-th batches of the three hold the k-th batch of one process at 192;
    resumed after 2 batches, each rank continues its own share."""
    dataset = ZINCDataModule(root=str(zinc_data_root)).load_split("val")  # 1,000 graphs
    split = ResidentSplit(dataset, dataset.graphs.to("cpu"))
    samplers = [SeededShuffleSampler(len(split), seed=1, batch_size=64, num_replicas=3, rank=rank)
                for rank in range(3)]
    ranks = [ResidentLoader(split, 64, sampler) for sampler in samplers]
    orders = [loader.order() for loader in ranks]
    assert [len(o) for o in orders] == [334] * 3 and [len(loader) for loader in ranks] == [6] * 3
    whole = SeededShuffleSampler(len(split), seed=1, batch_size=192).permutation()
    interleaved = np.stack(orders, 1).reshape(-1)
    np.testing.assert_array_equal(interleaved[:1000], whole)
    np.testing.assert_array_equal(interleaved[1000:], ~whole[:2])  # masked: ~i
    batches = [list(loader) for loader in ranks]
    for k, one in enumerate(whole[i:i + 192] for i in range(0, 1000, 192)):
        served = torch.cat([b[k].index for b in batches])
        assert sorted(p for p in served.tolist() if p >= 0) == sorted(dataset.positions[one].tolist())
    for rank in (1, 2):
        last = batches[rank][-1]
        assert last.index.tolist()[-1] == -1 and torch.isnan(last.y[-1]).all() and not torch.isnan(last.y[:-1]).any()
    samplers[1].batches_done = lambda: 2
    rest = orders[1][128:]
    expected = np.where(rest < 0, -1, dataset.positions[np.where(rest < 0, ~rest, rest)])
    assert torch.cat([b.index for b in ranks[1]]).tolist() == expected.tolist()


def test_bad_loader_arguments(zinc_data_root):
    dataset = ZINCDataModule(root=str(zinc_data_root)).load_split("val")
    split = ResidentSplit(dataset, dataset.graphs.to("cpu"))
    with pytest.raises(ValueError, match="batch_size"):
        ResidentLoader(split, 0)
    with pytest.raises(ValueError, match="rank"):
        SeededShuffleSampler(1000, num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="sampler covers 10 items but the split has 1000"):
        ResidentLoader(split, 8, SeededShuffleSampler(10))

"""Shape-stable training batches (``static_shapes``): one shape for every training batch, the
same graphs as without padding, and the same batches from the resident and DataLoader paths."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from graphormer_urpe.data.batch import BatchPadding
from graphormer_urpe.data.batch import collate
from graphormer_urpe.data import ZINCDataModule
from graphormer_urpe.data.batch import gather_batch
from graphormer_urpe.data.resident import OrderSlice, ResidentLoader, ResidentSplit

from test_resident import assert_same_batch


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_padded_batch_holds_the_unpadded_batch(zinc_data_root):
    """Real ZINC: the padded batch is the unpadded one plus padding (masked nodes, spd -1, no path
    edges, zero edge rows), from numpy and torch alike."""
    graphs = ZINCDataModule(root=str(zinc_data_root)).train_dataset().graphs
    padding = BatchPadding.covering(graphs.num_nodes, np.diff(graphs.edge_ptr), 32)
    index = np.random.default_rng(0).integers(0, len(graphs), 32)
    plain, padded = collate(graphs, index), collate(graphs, index, padding=padding)
    b, n = plain.node_mask.shape
    e = plain.edge_attr.shape[0] - 1
    assert padded.x.shape[:2] == padded.spd.shape[:2] == (32, padding.num_nodes)
    assert padded.edge_attr.shape[0] == padding.num_edges + 1 and padding.num_nodes > n
    assert torch.equal(padded.x[:, :n], plain.x) and not padded.x[:, n:].any()
    assert torch.equal(padded.node_mask[:, :n], plain.node_mask) and not padded.node_mask[:, n:].any()
    assert torch.equal(padded.degree[:, :n], plain.degree)
    assert torch.equal(padded.spd[:, :n, :n], plain.spd)
    assert (padded.spd[:, n:] == -1).all() and (padded.spd[:, :, n:] == -1).all()
    assert torch.equal(padded.path_edges[:, :n, :n], plain.path_edges)
    assert (padded.path_edges[:, n:] == -1).all() and (padded.path_edges[:, :, n:] == -1).all()
    assert torch.equal(padded.edge_attr[:e], plain.edge_attr[:e]) and not padded.edge_attr[e:].any()
    for name in ("y", "num_nodes", "index"):
        assert torch.equal(getattr(padded, name), getattr(plain, name))
    on_cpu = graphs.to("cpu")
    assert_same_batch(padded, gather_batch(on_cpu, torch.from_numpy(index), padding=padding))


def test_padding_covers_every_batch_and_rejects_a_larger_one(zinc_data_root):
    num_edges = np.array([4, 10, 6, 8])
    padding = BatchPadding.covering(np.array([3, 9, 5, 7]), num_edges, 2)
    assert padding == BatchPadding(num_nodes=9, num_edges=18)  # the two largest edge counts
    graphs = ZINCDataModule(root=str(zinc_data_root)).train_dataset().graphs
    with pytest.raises(ValueError, match="does not fit the padding N=2"):
        collate(graphs, [0, 1], padding=BatchPadding(2, 1000))
    with pytest.raises(ValueError, match="does not fit the padding"):
        gather_batch(graphs.to("cpu"), torch.tensor([0, 1]), padding=BatchPadding(64, 3))


def test_static_shapes_training_batches_have_one_shape(zinc_data_root):
    """ZINC-12k train, batch 64: 10,000 // 64 = 156 batches (the last incomplete one dropped),
    each of one shape; the resident loader yields each batch's place in the epoch order, which
    gathered as the training step gathers it is the DataLoader's batch bit for bit; the
    validation batches stay unpadded."""
    kwargs = {"root": str(zinc_data_root), "batch_size": 64, "static_shapes": True}
    loader_dm, resident_dm = ZINCDataModule(**kwargs), ZINCDataModule(**kwargs, device_resident=True)
    for dm in (loader_dm, resident_dm):
        dm.setup("fit")
    loader, resident = loader_dm.train_dataloader(), resident_dm.train_dataloader()
    assert resident.static_shapes and resident.sampler.static_shapes
    assert len(loader) == len(resident) == 10_000 // 64
    shapes, count, offsets = set(), 0, torch.arange(64)
    for expected, part in zip(loader, resident, strict=True):
        assert isinstance(part, OrderSlice) and part.size == 64
        batch = resident.split.gather(part.order, part.start, offsets)
        shapes.add(tuple(tuple(t.shape) for t in (batch.x, batch.spd, batch.edge_attr, batch.path_edges, batch.y)))
        assert_same_batch(expected, batch)
        count += 1
    assert count == 156 and len(shapes) == 1
    assert shapes.pop()[0][:2] == (64, 37)  # ZINC-12k's largest training graph has 37 atoms
    widths = {batch.x.shape[1] for _, batch in zip(range(4), resident_dm.val_dataloader())}
    assert len(widths) > 1


def test_static_shapes_needs_a_padded_split(zinc_data_root):
    dataset = ZINCDataModule(root=str(zinc_data_root)).train_dataset()
    split = ResidentSplit(dataset, dataset.graphs.to("cpu"))
    with pytest.raises(ValueError, match="static_shapes needs a split padded to one shape"):
        ResidentLoader(split, 16, static_shapes=True)
    with pytest.raises(ValueError, match="needs a split padded to one shape"):
        split.gather(torch.arange(16), 0, torch.arange(16))


def test_static_shapes_needs_a_full_batch(zinc_data_root):
    dm = ZINCDataModule(root=str(zinc_data_root), batch_size=20_000, static_shapes=True)
    dm.setup("fit")
    with pytest.raises(ValueError, match="only 10000 graphs for batch_size=20000"):
        dm.train_dataloader()

"""The encoding registry: every registered encoding is stored, collated and gathered on the
device as its entry says (layout, dtype, padding, edge-row shift), on real ZINC."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from graphormer_urpe.data.batch import BatchPadding
from graphormer_urpe.data.batch import collate
from graphormer_urpe.data.graphs import FlatGraphs
from graphormer_urpe.data import ZINCDataModule
from graphormer_urpe.data.encodings import ENCODINGS, Encoding, EncodingParams
from graphormer_urpe.data.batch import gather_batch

pytestmark = pytest.mark.usefixtures("one_torch_thread")


PARAMS = EncodingParams(max_hops=3, rwse_steps=4)  # every encoder on


def expected_values(graphs: FlatGraphs, enc: Encoding, index: np.ndarray) -> list[np.ndarray]:
    """Per batch graph, its stored values ``[n, *S]`` or ``[n, n, *S]``, local edge ids shifted
    by the edges of the graphs before it."""
    stored, shape = graphs.encodings[enc.name], enc.row_shape(PARAMS)
    ptr = graphs.node_ptr if enc.per == "node" else graphs.pair_ptr
    edges_before, out = 0, []
    for g in index:
        n = int(graphs.num_nodes[g])
        lead = (n, n) if enc.per == "pair" else (n,)
        values = np.asarray(stored[ptr[g]:ptr[g + 1]]).reshape(*lead, *shape)
        if enc.edge_ids:
            values = np.where(values >= 0, values + edges_before, values)
        out.append(values)
        edges_before += int(graphs.num_edges[g])
    return out


def test_every_encoding_is_batched_as_registered(zinc_data_root):
    graphs = ZINCDataModule(root=str(zinc_data_root), **PARAMS.as_dict()).load_split("val").graphs
    index = np.array([4, 900, 4, 17, 333])
    exact = BatchPadding(int(graphs.num_nodes[index].max()), int(graphs.num_edges[index].sum()))
    on_device = graphs.to("cpu")
    batches = {"collate": collate(graphs, index),
               "gather_batch": gather_batch(on_device, torch.from_numpy(index)),
               "gather_batch padded": gather_batch(on_device, torch.from_numpy(index), padding=exact)}
    big_n = int(graphs.num_nodes[index].max())
    assert big_n > int(graphs.num_nodes[index].min()), "the batch needs padding to test it"
    assert list(graphs.encodings) == [enc.name for enc in ENCODINGS]
    for enc in ENCODINGS:
        assert graphs.encodings[enc.name].dtype == enc.dtype
        expected = expected_values(graphs, enc, index)
        lead = (big_n,) * (1 + (enc.per == "pair"))
        for path, batch in batches.items():
            assert list(batch.encodings) == list(graphs.encodings)
            values = batch.encodings[enc.name]
            assert values.dtype == torch.from_numpy(np.zeros(0, enc.batch_dtype)).dtype, (path, enc.name)
            assert values.shape == (len(index), *lead, *enc.row_shape(PARAMS)), (path, enc.name)
            for b, real in enumerate(expected):
                n = real.shape[0]
                block = values[b].numpy()
                assert np.array_equal(block[(slice(0, n),) * len(lead)], real), (path, enc.name, b)
                padded = np.ones(lead, dtype=bool)
                padded[(slice(0, n),) * len(lead)] = False
                assert (block[padded] == enc.fill).all(), (path, enc.name, b)


def test_an_encoding_is_per_node_or_per_pair():
    with pytest.raises(ValueError, match="per must be 'node' or 'pair'"):
        Encoding("ring_size", "edge", np.int16, np.int16, fill=0)

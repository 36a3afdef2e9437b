r"""Graphormer + URPE on any PyG dataset, in a plain PyTorch loop (docs/pyg.md):
:class:`GraphormerEncodings` adds the structural encodings to a ``Data`` in their stored layout
(:mod:`~.encodings`: flat along dim 0, so PyG's ``DataLoader`` concatenates them), and
:func:`to_graph_batch` turns the resulting ``Batch`` into the padded :class:`~.batch.GraphBatch`
the model takes. ``x`` and ``edge_attr`` keep their raw integer values; the shared embedding
ids are made at batching time."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch_geometric.data import Data
from torch_geometric.transforms import BaseTransform

from graphormer_urpe.data.batch import GraphBatch, collate
from graphormer_urpe.data.graphs import FlatGraphs
from graphormer_urpe.data.encodings import CORE_ENCODINGS, DEFAULT_MAX_HOPS, ENCODING_BY_NAME, EncodingParams
from graphormer_urpe.data.feature_ids import check_integer_features, to_shared_ids


class GraphormerEncodings(BaseTransform):
    """Adds ``spd``, ``path_edges``, ``degree`` and the optional encodings to a ``Data``; ``max_hops``
    (``K``) and the other :class:`~.encodings.EncodingParams` fields."""

    def __init__(self, max_hops: int = DEFAULT_MAX_HOPS, **params: int) -> None:
        self.params = EncodingParams(max_hops=int(max_hops), **params)
        self.max_hops = self.params.max_hops

    def forward(self, data: Data) -> Data:
        for name, kind in (("x", "atom"), ("edge_attr", "bond")):  # what to_graph_batch embeds
            if data.get(name) is None:
                raise ValueError(f"the graph has no {name}: Graphormer embeds integer {kind} "
                                 f"features (a {kind} type per {'node' if kind == 'atom' else 'edge'} "
                                 "at least); add them before GraphormerEncodings")
            check_integer_features(data[name].numpy(), f"{kind} ({name})")
        n = int(data.num_nodes)
        edge_index = np.ascontiguousarray(data.edge_index.numpy(), dtype=np.int64)
        node_ptr = np.array([0, n], dtype=np.int64)
        edge_ptr = np.array([0, edge_index.shape[1]], dtype=np.int64)
        for encoder in self.params.encoders():
            values = encoder.compute(node_ptr, edge_index, edge_ptr, self.params, 1)
            for enc in encoder.encodings:
                data[enc.name] = torch.from_numpy(np.ascontiguousarray(values[enc.name]))
        return data

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.params.describe()})"


def to_graph_batch(batch, atom_feature_dims: Sequence[int], bond_feature_dims: Sequence[int]) -> GraphBatch:
    """A PyG ``Batch`` of graphs carrying :class:`GraphormerEncodings` -> :class:`GraphBatch`, with the
    vocabulary size of each column of ``x`` / ``edge_attr`` (a value outside is a ValueError naming
    the column); ``y`` as ``[B, T]``, NaN without one."""
    missing = [name for name in CORE_ENCODINGS if name not in batch]
    if missing:
        raise ValueError(f"the batch has no {missing}: add GraphormerEncodings() as the dataset's "
                         "transform or pre_transform")
    num_graphs = int(batch.num_graphs)
    node_ptr = batch.ptr.numpy().astype(np.int64)
    num_nodes = np.diff(node_ptr)
    src = batch.edge_index[0].numpy()
    # Edges are concatenated graph by graph, so each graph's edges are one contiguous run.
    edge_counts = np.bincount(batch.batch.numpy()[src], minlength=num_graphs)
    edge_ptr = np.concatenate([[0], np.cumsum(edge_counts)]).astype(np.int64)
    y = batch.y.reshape(num_graphs, -1).float().numpy() if batch.get("y") is not None \
        else np.full((num_graphs, 1), np.nan, np.float32)
    flat = FlatGraphs(
        x=to_shared_ids(batch.x.numpy(), atom_feature_dims, "atom"), node_ptr=node_ptr,
        edge_attr=to_shared_ids(batch.edge_attr.numpy(), bond_feature_dims, "bond"), edge_ptr=edge_ptr,
        y=y, pair_ptr=np.concatenate([[0], np.cumsum(num_nodes * num_nodes)]).astype(np.int64),
        encodings={name: batch[name].numpy() for name in ENCODING_BY_NAME if name in batch})
    return collate(flat, np.arange(num_graphs))

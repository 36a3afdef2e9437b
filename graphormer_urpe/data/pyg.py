r"""Graphormer + URPE on any PyG dataset, in a plain PyTorch loop.

:class:`GraphormerEncodings` is a ``torch_geometric.transforms.BaseTransform`` that adds this
project's structural encodings (:mod:`graphormer_urpe.algos`, the Cython encoder) to a ``Data``
with ``n`` nodes, in the stored layout of :data:`~.encoding_registry.ENCODINGS`:

- ``spd`` int16 ``[n * n]``: shortest-path hops, pair ``(i, j)`` at ``i * n + j`` (-1 unreachable);
- ``path_edges`` int16 ``[n * n, K]``: local edge ids (columns of ``edge_index``) along one
  shortest path, -1 padded;
- ``degree`` int16 ``[n]``: out-degree.

All three are flat along dim 0, so PyG's own ``DataLoader`` batches them by concatenation, and
:func:`to_graph_batch` turns the resulting ``Batch`` into the padded
:class:`~.batch.GraphBatch` that :class:`~graphormer_urpe.nn.graphormer.Graphormer` takes::

    dataset = ZINC(root, subset=True, pre_transform=GraphormerEncodings(max_hops=5))
    loader = torch_geometric.loader.DataLoader(dataset, batch_size=64, shuffle=True)
    model = Graphormer(num_atom_embeddings=num_embeddings(ATOM_DIMS), ...)
    for batch in loader:
        out = model(to_graph_batch(batch, ATOM_DIMS, BOND_DIMS))

``x`` and ``edge_attr`` keep their raw integer values (column ``c`` in ``[0, dims[c])``); the
shared embedding ids of :mod:`.features` are made at batching time, so the transform needs to
know nothing about the vocabularies. As a ``pre_transform`` the encodings are computed once and
saved with the processed dataset; as a ``transform`` they are computed per access (see
``docs/pyg.md`` for what that costs).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch_geometric.data import Data
from torch_geometric.transforms import BaseTransform

from graphormer_urpe.algos import shortest_paths
from graphormer_urpe.data.batch import GraphBatch
from graphormer_urpe.data.collate import FlatGraphs, collate
from graphormer_urpe.data.encoding_registry import ENCODINGS
from graphormer_urpe.data.features import to_shared_ids


class GraphormerEncodings(BaseTransform):
    """Adds ``spd``, ``path_edges`` and ``degree`` (module docstring) to a ``Data``.

    Args:
        max_hops: ``K``, edges kept per shortest path (the model's ``max_hops``).
    """

    def __init__(self, max_hops: int = 5) -> None:
        self.max_hops = int(max_hops)

    def forward(self, data: Data) -> Data:
        n = int(data.num_nodes)
        edge_index = np.ascontiguousarray(data.edge_index.numpy(), dtype=np.int64)
        spd, path_edges = shortest_paths(n, edge_index, self.max_hops)
        degree = np.bincount(edge_index[0], minlength=n)
        values = {"spd": spd, "path_edges": path_edges, "degree": degree}
        for enc in ENCODINGS:
            stored = np.asarray(values[enc.name], dtype=enc.dtype).reshape(-1, *enc.row_shape(self.max_hops))
            data[enc.name] = torch.from_numpy(np.ascontiguousarray(stored))
        return data

    def __repr__(self) -> str:
        return f"{type(self).__name__}(max_hops={self.max_hops})"


def to_graph_batch(batch, atom_feature_dims: Sequence[int], bond_feature_dims: Sequence[int]) -> GraphBatch:
    """A PyG ``Batch`` of graphs carrying :class:`GraphormerEncodings` -> :class:`GraphBatch`.

    ``atom_feature_dims`` / ``bond_feature_dims``: the vocabulary size of each column of ``x`` /
    ``edge_attr`` (e.g. ZINC: ``(28,)`` and ``(4,)``,
    :data:`~.featurize.ZINC_ATOM_FEATURE_DIMS`); a value outside its column's range is a
    ValueError naming the column. ``y`` is taken as ``[B, T]`` (NaN = unknown); a batch without
    ``y`` gets NaN.
    """
    missing = [e.name for e in ENCODINGS if e.name not in batch]
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
        **{e.name: batch[e.name].numpy() for e in ENCODINGS})
    return collate(flat, np.arange(num_graphs))

r"""Collation: encoded graphs stored as flat arrays -> one padded :class:`GraphBatch`.

A split of ``G`` graphs lives in :class:`FlatGraphs` as CSR-like flat arrays (graph ``g`` owns node
rows ``node_ptr[g]:node_ptr[g+1]``, edge rows ``edge_ptr[g]:edge_ptr[g+1]`` and node-pair rows
``pair_ptr[g]:pair_ptr[g+1]`` with ``pair_ptr[g+1] - pair_ptr[g] = n_g^2``, pair ``(i, j)`` at
``i * n_g + j``). :func:`collate` gathers any ``B`` graphs into tensors padded to
``N = max_b n_b``: vectorised numpy gathers for nodes and edges and one block copy per graph for
the ``O(n^2)`` pair arrays, so a ``DataLoader`` builds a whole batch in one ``__getitems__`` call
(> 40,000 ZINC graphs/s on one core).

Path edges are stored as LOCAL edge ids (relative to ``edge_ptr[g]``, as the encoder returns
them); collation turns them into rows of the batch's ``edge_attr`` by adding the number of edges
of the graphs before ``b`` in the batch. ``-1`` stays ``-1``, which indexes the all-zero last row
of ``edge_attr``, so ``edge_attr[path_edges]`` needs no masking.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from graphormer_urpe.algos import UNREACHABLE, encode_graphs  # padded pairs: UNREACHABLE too
from graphormer_urpe.data.batch import BatchPadding, GraphBatch
from graphormer_urpe.data.features import to_shared_ids


@dataclass(frozen=True)
class FlatGraphs:
    """``G`` featurized and encoded graphs as flat arrays (numpy, possibly memory-mapped).

    Attributes:
        x: ``[sum n, F]`` int16 shared atom ids (0 = padding, see :mod:`.features`).
        node_ptr: ``[G + 1]`` int64.
        edge_attr: ``[sum E, Fe]`` int16 shared bond ids; directed edges, in the order the
            encoder saw them (path edge ids refer to these rows).
        edge_ptr: ``[G + 1]`` int64.
        y: ``[G, T]`` float32 targets (NaN = unknown).
        spd: ``[sum n^2]`` int16 shortest-path hops, ``-1`` = unreachable.
        path_edges: ``[sum n^2, K]`` int16 local edge ids along one shortest path, ``-1`` pad.
        degree: ``[sum n]`` int16 out-degree.
        pair_ptr: ``[G + 1]`` int64, ``pair_ptr[g + 1] - pair_ptr[g] = n_g^2``.
    """

    x: np.ndarray
    node_ptr: np.ndarray
    edge_attr: np.ndarray
    edge_ptr: np.ndarray
    y: np.ndarray
    spd: np.ndarray
    path_edges: np.ndarray
    degree: np.ndarray
    pair_ptr: np.ndarray

    def __post_init__(self) -> None:
        g = len(self.node_ptr) - 1
        n = np.diff(self.node_ptr)
        checks = {
            "edge_ptr": len(self.edge_ptr) == g + 1,
            "pair_ptr": len(self.pair_ptr) == g + 1,
            "y rows": self.y.ndim == 2 and self.y.shape[0] == g,
            "x rows": self.x.ndim == 2 and self.x.shape[0] == self.node_ptr[-1],
            "degree rows": self.degree.shape == (self.node_ptr[-1],),
            "edge_attr rows": self.edge_attr.ndim == 2 and self.edge_attr.shape[0] == self.edge_ptr[-1],
            "spd rows": self.spd.shape == (self.pair_ptr[-1],),
            "path_edges rows": self.path_edges.ndim == 2 and self.path_edges.shape[0] == self.pair_ptr[-1],
            "pair_ptr = cumsum(n^2)": g == 0 or np.array_equal(np.diff(self.pair_ptr), n * n),
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"inconsistent FlatGraphs arrays: {', '.join(bad)}")

    @property
    def max_hops(self) -> int:
        """``K``: path edges stored per node pair."""
        return int(self.path_edges.shape[1])

    @property
    def num_nodes(self) -> np.ndarray:
        """``[G]`` int64 node counts."""
        return np.diff(self.node_ptr)

    @property
    def num_edges(self) -> np.ndarray:
        """``[G]`` int64 directed edge counts."""
        return np.diff(self.edge_ptr)

    def __len__(self) -> int:
        return len(self.node_ptr) - 1


def _ragged_positions(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For ragged rows of lengths ``counts [B]``: ``(owner, local)``, each ``[sum counts]``, the
    row each element belongs to and its position inside that row."""
    owner = np.repeat(np.arange(counts.size), counts)
    starts = np.cumsum(counts) - counts
    local = np.arange(owner.size) - starts[owner]
    return owner, local


def collate(graphs: FlatGraphs, indices: Sequence[int] | np.ndarray, y: np.ndarray | None = None,
            positions: np.ndarray | None = None, padding: BatchPadding | None = None) -> GraphBatch:
    """Gather graphs ``indices`` (``B`` of them, any order, repeats allowed) into a padded batch.

    ``N`` = the largest node count among them; see :class:`GraphBatch` for shapes and padding.
    ``y [B, T]`` and ``positions [B]`` override ``graphs.y[indices]`` and ``GraphBatch.index``
    (default: ``indices``) when several data rows share one stored graph (deduplicated SMILES).
    ``padding`` fixes ``N`` and ``E`` instead (:class:`~.batch.BatchPadding`).
    """
    index = np.asarray(indices, dtype=np.int64).reshape(-1)
    if index.size and (index.min() < 0 or index.max() >= len(graphs)):
        raise ValueError(f"graph indices must lie in [0, {len(graphs)}), got "
                         f"[{index.min()}, {index.max()}]")
    b = index.size
    k = graphs.max_hops

    node_start = graphs.node_ptr[index]
    n = graphs.node_ptr[index + 1] - node_start
    big_n = int(n.max()) if b else 0
    edge_start = graphs.edge_ptr[index]
    m = graphs.edge_ptr[index + 1] - edge_start
    edge_rows = int(m.sum())
    if padding is not None:
        padding.check(big_n, edge_rows)
        big_n, edge_rows = padding.num_nodes, padding.num_edges

    # Nodes: destination b * N + local in a [B * N] grid.
    node_owner, node_local = _ragged_positions(n)
    node_src = node_start[node_owner] + node_local
    node_dst = node_owner * big_n + node_local
    x = np.zeros((b * big_n, graphs.x.shape[1]), dtype=np.int32)
    x[node_dst] = graphs.x[node_src]
    degree = np.zeros(b * big_n, dtype=np.int16)
    degree[node_dst] = graphs.degree[node_src]
    node_mask = np.zeros(b * big_n, dtype=bool)
    node_mask[node_dst] = True

    # Edges: concatenated, plus the all-zero row that path edge -1 resolves to.
    edge_owner, edge_local = _ragged_positions(m)
    edge_attr = np.zeros((edge_rows + 1, graphs.edge_attr.shape[1]), dtype=np.int32)
    edge_attr[:edge_owner.size] = graphs.edge_attr[edge_start[edge_owner] + edge_local]
    edge_offset = np.cumsum(m) - m  # first batch row of each graph's edges

    # Node pairs: graph g's [n, n] (and [n, n, K]) block is contiguous in storage, so one slice
    # copy per graph is ~3x faster than a fancy-index gather of all pairs (measured on ZINC).
    spd = np.full((b, big_n, big_n), UNREACHABLE, dtype=np.int16)
    path_edges = np.full((b, big_n, big_n, k), -1, dtype=np.int32)
    pair_start = graphs.pair_ptr[index].tolist()
    for row, (size, start, offset) in enumerate(zip(n.tolist(), pair_start, edge_offset.tolist())):
        end = start + size * size
        spd[row, :size, :size] = graphs.spd[start:end].reshape(size, size)
        block = path_edges[row, :size, :size]
        block[...] = graphs.path_edges[start:end].reshape(size, size, k)
        block += offset & ~(block >> 31)  # local -> batch edge row; -1 stays -1 (x >> 31 = -1 iff x < 0)

    return GraphBatch(
        x=torch.from_numpy(x.reshape(b, big_n, graphs.x.shape[1])),
        node_mask=torch.from_numpy(node_mask.reshape(b, big_n)),
        degree=torch.from_numpy(degree.reshape(b, big_n)),
        spd=torch.from_numpy(spd),
        edge_attr=torch.from_numpy(edge_attr),
        path_edges=torch.from_numpy(path_edges),
        y=torch.from_numpy(np.ascontiguousarray(graphs.y[index] if y is None else y, dtype=np.float32)),
        num_nodes=torch.from_numpy(n.astype(np.int32)),
        index=torch.from_numpy(np.array(index if positions is None else positions, dtype=np.int64)),
    )


def encode_flat(
    x: np.ndarray,
    node_ptr: np.ndarray,
    edge_index: np.ndarray,
    edge_attr: np.ndarray,
    edge_ptr: np.ndarray,
    y: np.ndarray,
    *,
    max_hops: int,
    atom_feature_dims: Sequence[int],
    bond_feature_dims: Sequence[int],
    num_threads: int = 1,
) -> FlatGraphs:
    """Featurize (shared ids) and encode raw flat graphs.

    Args:
        x: ``[sum n, F]`` (or ``[sum n]``) raw atom feature values, column c in ``[0, dims[c])``.
        node_ptr, edge_ptr: ``[G + 1]`` offsets.
        edge_index: ``[2, sum E]`` directed edges, LOCAL node ids per graph.
        edge_attr: ``[sum E, Fe]`` (or ``[sum E]``) raw bond feature values.
        y: ``[G, T]`` (or ``[G]``) targets.
    """
    node_ptr = np.ascontiguousarray(node_ptr, dtype=np.int64)
    edge_ptr = np.ascontiguousarray(edge_ptr, dtype=np.int64)
    enc = encode_graphs(node_ptr, np.ascontiguousarray(edge_index, dtype=np.int64), edge_ptr,
                        max_hops, num_threads=num_threads)
    y = np.asarray(y, dtype=np.float32)
    return FlatGraphs(
        x=to_shared_ids(x, atom_feature_dims, "atom"),
        node_ptr=node_ptr,
        edge_attr=to_shared_ids(edge_attr, bond_feature_dims, "bond"),
        edge_ptr=edge_ptr,
        y=y.reshape(len(node_ptr) - 1, -1),
        spd=np.asarray(enc.spd, dtype=np.int16),
        path_edges=np.asarray(enc.path_edges, dtype=np.int16).reshape(-1, max_hops),
        degree=np.asarray(enc.degree, dtype=np.int16),
        pair_ptr=np.asarray(enc.pair_ptr, dtype=np.int64),
    )


def collate_pyg_graphs(
    data_list: Sequence,
    max_hops: int,
    atom_feature_dims: Sequence[int],
    bond_feature_dims: Sequence[int],
) -> GraphBatch:
    """Encode and collate a few ``torch_geometric.data.Data`` graphs (tests, inference).

    Each ``Data`` needs ``x`` (``[n, F]`` or ``[n]`` raw values), ``edge_index`` (``[2, E]``),
    ``edge_attr`` (``[E, Fe]`` or ``[E]``) and optionally ``y`` (``T`` values; missing -> NaN).
    """
    if len(data_list) == 0:
        raise ValueError("collate_pyg_graphs needs at least one graph")
    n = np.array([int(d.num_nodes) for d in data_list], dtype=np.int64)
    e = np.array([int(d.edge_index.shape[1]) for d in data_list], dtype=np.int64)
    num_bond_cols = len(bond_feature_dims)
    ys = [None if getattr(d, "y", None) is None else d.y.reshape(-1).numpy() for d in data_list]
    num_targets = max((len(v) for v in ys if v is not None), default=1)
    y = np.stack([np.full(num_targets, np.nan, np.float32) if v is None else v for v in ys])
    flat = encode_flat(
        x=np.concatenate([d.x.numpy().reshape(int(d.num_nodes), -1) for d in data_list]),
        node_ptr=np.concatenate([[0], np.cumsum(n)]),
        edge_index=np.concatenate([d.edge_index.numpy() for d in data_list], axis=1),
        edge_attr=np.concatenate([d.edge_attr.numpy().reshape(-1, num_bond_cols) for d in data_list]),
        edge_ptr=np.concatenate([[0], np.cumsum(e)]),
        y=y, max_hops=max_hops,
        atom_feature_dims=atom_feature_dims, bond_feature_dims=bond_feature_dims,
    )
    return collate(flat, np.arange(len(data_list)))

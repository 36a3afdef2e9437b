r"""Collation: encoded graphs stored as flat arrays -> one padded :class:`GraphBatch`.

A split of ``G`` graphs lives in :class:`FlatGraphs` as CSR-like flat arrays (graph ``g`` owns node
rows ``node_ptr[g]:node_ptr[g+1]``, edge rows ``edge_ptr[g]:edge_ptr[g+1]`` and node-pair rows
``pair_ptr[g]:pair_ptr[g+1]`` with ``pair_ptr[g+1] - pair_ptr[g] = n_g^2``, pair ``(i, j)`` at
``i * n_g + j``). :func:`collate` gathers any ``B`` graphs into tensors padded to
``N = max_b n_b``: vectorised numpy gathers for nodes and edges and one block copy per graph for
the ``O(n^2)`` pair arrays, so a ``DataLoader`` builds a whole batch in one ``__getitems__`` call
(> 40,000 ZINC graphs/s on one core).

The node and node-pair encodings, whichever the graphs carry, are gathered as their specs in
:mod:`~.encodings` say (per node or pair, dtype, padding value). Path edges are stored as LOCAL edge ids (relative to
``edge_ptr[g]``, as the encoder returns them); collation turns them into rows of the batch's
``edge_attr`` by adding the number of edges of the graphs before ``b`` in the batch. ``-1``
stays ``-1``, which indexes the all-zero last row of ``edge_attr``, so
``edge_attr[path_edges]`` needs no masking.
"""
from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch
from torch import Tensor

from graphormer_urpe.data.batch import BatchPadding, GraphBatch
from graphormer_urpe.data.encodings import ENCODING_BY_NAME, Encoding


@dataclass(frozen=True)
class FlatGraphs:
    """``G`` featurized and encoded graphs as flat arrays: numpy (possibly memory-mapped; the
    row counts are checked against the pointers) or, after :meth:`to`, torch tensors on one
    device (same fields, same compact dtypes) for the device-resident path (:mod:`.resident`).

    Attributes:
        x: ``[sum n, F]`` int16 shared atom ids (0 = padding, see :mod:`.feature_ids`).
        node_ptr: ``[G + 1]`` int64.
        edge_attr: ``[sum E, Fe]`` int16 shared bond ids; directed edges, in the order the
            encoder saw them (path edge ids refer to these rows).
        edge_ptr: ``[G + 1]`` int64.
        y: ``[G, T]`` float32 targets (NaN = unknown).
        pair_ptr: ``[G + 1]`` int64, ``pair_ptr[g + 1] - pair_ptr[g] = n_g^2``.
        encodings: name -> stored array, in the layout of :mod:`~.encodings`
            (``spd [sum n^2]`` shortest-path hops, ``-1`` = unreachable; ``path_edges [sum n^2, K]``
            local edge ids along one shortest path, ``-1`` pad; ``degree [sum n]`` out-degree;
            optional ones such as ``rwse [sum n, S]``).
    """

    x: np.ndarray | Tensor
    node_ptr: np.ndarray | Tensor
    edge_attr: np.ndarray | Tensor
    edge_ptr: np.ndarray | Tensor
    y: np.ndarray | Tensor
    pair_ptr: np.ndarray | Tensor
    encodings: dict[str, np.ndarray | Tensor]

    def __post_init__(self) -> None:
        if isinstance(self.x, Tensor):  # made by :meth:`to` from checked arrays
            return
        g = len(self.node_ptr) - 1
        n = np.diff(self.node_ptr)
        rows = {"node": self.node_ptr[-1], "pair": self.pair_ptr[-1]}
        checks = {
            "edge_ptr": len(self.edge_ptr) == g + 1,
            "pair_ptr": len(self.pair_ptr) == g + 1,
            "y rows": self.y.ndim == 2 and self.y.shape[0] == g,
            "x rows": self.x.ndim == 2 and self.x.shape[0] == self.node_ptr[-1],
            "edge_attr rows": self.edge_attr.ndim == 2 and self.edge_attr.shape[0] == self.edge_ptr[-1],
            **{f"{name} rows": name in ENCODING_BY_NAME and values.ndim == 1 + bool(ENCODING_BY_NAME[name].width)
               and values.shape[0] == rows[ENCODING_BY_NAME[name].per] for name, values in self.encodings.items()},
            "pair_ptr = cumsum(n^2)": g == 0 or np.array_equal(np.diff(self.pair_ptr), n * n),
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"inconsistent FlatGraphs arrays: {', '.join(bad)}")

    def specs(self) -> list[tuple[Encoding, np.ndarray | Tensor]]:
        """``(spec, stored array)`` of every encoding, in storage order."""
        return [(ENCODING_BY_NAME[name], values) for name, values in self.encodings.items()]

    def __len__(self) -> int:
        return len(self.node_ptr) - 1

    @property
    def num_nodes(self) -> np.ndarray | Tensor:
        """``[G]`` int64 node counts."""
        return self.node_ptr[1:] - self.node_ptr[:-1]

    @property
    def num_edges(self) -> np.ndarray | Tensor:
        """``[G]`` int64 directed edge counts."""
        return self.edge_ptr[1:] - self.edge_ptr[:-1]

    @property
    def device(self) -> torch.device:
        """Where the arrays are (the CPU for numpy ones)."""
        return self.x.device if isinstance(self.x, Tensor) else torch.device("cpu")

    def to(self, device: torch.device | str = "cpu") -> "FlatGraphs":
        """The graphs as torch tensors on ``device``, dtypes kept; on the CPU a copy, detached
        from any memory map."""
        device = torch.device(device)

        def tensor(array: np.ndarray) -> Tensor:
            with warnings.catch_warnings():  # read-only maps: torch warns about writes we never make
                warnings.simplefilter("ignore", UserWarning)
                values = torch.from_numpy(np.asarray(array))
            return values.to(device, copy=device.type == "cpu")

        return FlatGraphs(**{f.name: tensor(getattr(self, f.name)) for f in fields(self) if f.name != "encodings"},
                          encodings={name: tensor(values) for name, values in self.encodings.items()})


def _ragged_positions(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For ragged rows of lengths ``counts [B]``: ``(owner, local)``, each ``[sum counts]``, the
    row each element belongs to and its position inside that row."""
    owner = np.repeat(np.arange(counts.size), counts)
    starts = np.cumsum(counts) - counts
    local = np.arange(owner.size) - starts[owner]
    return owner, local


def collate(graphs: FlatGraphs, indices: Sequence[int] | np.ndarray, y: np.ndarray | None = None,
            positions: np.ndarray | None = None, padding: BatchPadding | None = None,
            descriptors: np.ndarray | None = None) -> GraphBatch:
    """Gather graphs ``indices`` (``B`` of them, any order, repeats allowed) into a padded batch.

    ``N`` = the largest node count among them; see :class:`GraphBatch` for shapes and padding.
    ``y [B, T]`` and ``positions [B]`` override ``graphs.y[indices]`` and ``GraphBatch.index``
    (default: ``indices``) when several data rows share one stored graph (deduplicated SMILES).
    ``padding`` fixes ``N`` and ``E`` instead (:class:`~.batch.BatchPadding`). ``descriptors
    [B, D]``: each molecule's descriptors, carried as ``GraphBatch.descriptors``.
    """
    index = np.asarray(indices, dtype=np.int64).reshape(-1)
    if index.size and (index.min() < 0 or index.max() >= len(graphs)):
        raise ValueError(f"graph indices must lie in [0, {len(graphs)}), got "
                         f"[{index.min()}, {index.max()}]")
    b = index.size

    node_start = graphs.node_ptr[index]
    n = graphs.node_ptr[index + 1] - node_start
    big_n = int(n.max()) if b else 0
    edge_start = graphs.edge_ptr[index]
    m = graphs.edge_ptr[index + 1] - edge_start
    edge_rows = int(m.sum())
    targets = np.asarray(graphs.y[index] if y is None else y, dtype=np.float32)
    positions = np.asarray(index if positions is None else positions, dtype=np.int64)
    if padding is not None:
        padding.check(big_n, edge_rows, b)
        big_n, edge_rows = padding.num_nodes, padding.num_edges

    # Nodes: destination b * N + local in a [B * N] grid.
    node_owner, node_local = _ragged_positions(n)
    node_src = node_start[node_owner] + node_local
    node_dst = node_owner * big_n + node_local
    x = np.zeros((b * big_n, graphs.x.shape[1]), dtype=np.int32)
    x[node_dst] = graphs.x[node_src]
    node_mask = np.zeros(b * big_n, dtype=bool)
    node_mask[node_dst] = True
    encoded = {}
    for enc, stored in graphs.specs():
        if enc.per == "node":
            values = np.full((b * big_n, *stored.shape[1:]), enc.fill, dtype=enc.batch_dtype)
            values[node_dst] = stored[node_src]
            encoded[enc.name] = values.reshape(b, big_n, *stored.shape[1:])

    # Edges: concatenated, plus the all-zero row that path edge -1 resolves to.
    edge_owner, edge_local = _ragged_positions(m)
    edge_attr = np.zeros((edge_rows + 1, graphs.edge_attr.shape[1]), dtype=np.int32)
    edge_attr[:edge_owner.size] = graphs.edge_attr[edge_start[edge_owner] + edge_local]
    edge_offset = (np.cumsum(m) - m).tolist()  # first batch row of each graph's edges

    # Node pairs: graph g's [n, n, *S] block is contiguous in storage, so one slice copy per
    # graph beats a fancy-index gather of all pairs.
    sizes, pair_start = n.tolist(), graphs.pair_ptr[index].tolist()
    for enc, stored in graphs.specs():
        if enc.per != "pair":
            continue
        # A plain view of a memory map: slicing np.memmap itself costs ~4 us per block in its
        # subclass hooks, about a quarter of this loop on ZINC.
        stored = np.asarray(stored)
        row_shape = stored.shape[1:]
        values = np.full((b, big_n, big_n, *row_shape), enc.fill, dtype=enc.batch_dtype)
        for row, (size, start) in enumerate(zip(sizes, pair_start)):
            block = values[row, :size, :size]
            block[...] = stored[start:start + size * size].reshape(size, size, *row_shape)
            if enc.edge_ids:  # local -> batch edge row; -1 stays -1 (x >> 31 = -1 iff x < 0)
                block += edge_offset[row] & ~(block >> 31)
        encoded[enc.name] = values

    return GraphBatch(
        x=torch.from_numpy(x.reshape(b, big_n, graphs.x.shape[1])),
        node_mask=torch.from_numpy(node_mask.reshape(b, big_n)),
        encodings={name: torch.from_numpy(encoded[name]) for name in graphs.encodings},
        edge_attr=torch.from_numpy(edge_attr),
        y=torch.from_numpy(np.ascontiguousarray(targets)),
        num_nodes=torch.from_numpy(n.astype(np.int32)),
        index=torch.from_numpy(np.array(positions, dtype=np.int64)),
        descriptors=None if descriptors is None else torch.from_numpy(np.array(descriptors, dtype=np.float32)),
    )

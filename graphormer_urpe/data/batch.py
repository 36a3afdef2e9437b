r"""The padded batch that flows into the model (:class:`GraphBatch`), and the two gathers that
make it, bit for bit the same: :func:`collate` from numpy (possibly memory-mapped)
:class:`~.graphs.FlatGraphs` for the ``DataLoader``, :func:`gather_batch` from tensors on a
device, every intermediate of a fixed shape so it can be recorded in a CUDA graph.

``B`` graphs, ``N`` the largest node count (without the graph token), ``E`` all edges, ``K``
``max_hops``. Path edges (stored as LOCAL edge ids) become rows of the batch's ``edge_attr``;
``-1`` indexes its all-zero last row, so ``edge_attr[path_edges]`` needs no masking."""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch
from torch import Tensor

from graphormer_urpe.data.encodings import ENCODING_BY_NAME, EncodingParams
from graphormer_urpe.data.graphs import FlatGraphs


@dataclass
class GraphBatch:
    """A padded batch of encoded graphs.

    Attributes:
        x: ``[B, N, F]`` int32 shared atom ids (0 = padding).
        node_mask: ``[B, N]`` bool, True at real nodes.
        edge_attr: ``[E + 1, Fe]`` int32 shared bond ids; the last row is all zeros, what
            ``path_edges == -1`` resolves to.
        y: ``[B, T]`` float32 targets (NaN where unknown).
        num_nodes: ``[B]`` int32 node counts.
        index: ``[B]`` int64 position of each graph in its split (prediction order).
        encodings: the structural encodings by name, each also an attribute (``batch.spd``):
            ``degree [B, N]``, ``spd [B, N, N]`` (-1 unreachable and padding), ``path_edges
            [B, N, N, K]`` (rows of ``edge_attr``, -1 where shorter) and those the data's
            parameters switch on (``rwse [B, N, S]``).
        descriptors: ``[B, D]`` float32 raw RDKit descriptors (``molecule_descriptors``), else None."""

    x: Tensor
    node_mask: Tensor
    edge_attr: Tensor
    y: Tensor
    num_nodes: Tensor
    index: Tensor
    encodings: dict[str, Tensor]
    descriptors: Tensor | None = None

    def __getattr__(self, name: str) -> Tensor:
        encodings = self.__dict__.get("encodings")
        if encodings is not None and name in encodings:
            return encodings[name]
        raise AttributeError(f"{type(self).__name__} has no field or encoding {name!r}")

    def tensors(self) -> dict[str, Tensor]:
        """Every tensor by name, encodings included (flat: ``{"x": ..., "spd": ...}``)."""
        plain = {name: getattr(self, name) for name in _TENSOR_FIELDS}
        return {**{name: t for name, t in plain.items() if t is not None}, **self.encodings}

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor]) -> "GraphBatch":
        """The inverse of :meth:`tensors`."""
        return cls(**{k: v for k, v in tensors.items() if k in _TENSOR_FIELDS},
                   encodings={k: v for k, v in tensors.items() if k not in _TENSOR_FIELDS})

    def map(self, fn) -> "GraphBatch":
        """Every tensor replaced by ``fn(tensor)``."""
        return self.from_tensors({name: fn(t) for name, t in self.tensors().items()})

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "GraphBatch":
        return self.map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "GraphBatch":
        return self.map(lambda t: t.pin_memory())

    def alone(self, g: int, times: int = 1) -> "GraphBatch":
        """Graph ``g`` alone, ``times`` copies of it, unpadded and with its own edge rows numbered from
        0: the same graph gives the same batch whatever batch it came from."""
        n = int(self.num_nodes[g])
        rows = torch.arange(g, g + 1, device=self.x.device).repeat(times)
        encodings, edge_rows = {}, self.edge_attr[:0]
        for name, values in self.encodings.items():
            spec = ENCODING_BY_NAME[name]
            values = values[rows, :n, :n] if spec.per == "pair" else values[rows, :n]
            if spec.edge_ids:  # this graph's rows are one block of the batch's edge_attr
                present = values[values >= 0]
                first = int(present.min()) if present.numel() else 0
                edge_rows = self.edge_attr[first:int(present.max()) + 1] if present.numel() else edge_rows
                values = torch.where(values >= 0, values - first, values)
            encodings[name] = values
        return GraphBatch(x=self.x[rows, :n], node_mask=self.node_mask[rows, :n],
                          edge_attr=torch.cat([edge_rows, torch.zeros_like(self.edge_attr[-1:])]),
                          y=self.y[rows], num_nodes=self.num_nodes[rows], index=self.index[rows],
                          encodings=encodings,
                          descriptors=None if self.descriptors is None else self.descriptors[rows])

    @property
    def num_graphs(self) -> int:
        return self.x.shape[0]

    def __len__(self) -> int:
        return self.num_graphs


#: GraphBatch's tensor fields, a constant ``torch.compile`` reads (it cannot trace ``fields``).
_TENSOR_FIELDS = tuple(f.name for f in fields(GraphBatch) if f.name != "encodings")


@dataclass(frozen=True)
class BatchPadding:
    """Fixed batch sizes for shape-stable training steps: ``N = num_nodes`` nodes per graph and
    ``E = num_edges`` edge rows, padded as :class:`GraphBatch` pads smaller graphs, so the loss
    and gradients are those of the unpadded batch."""

    num_nodes: int
    num_edges: int

    @classmethod
    def covering(cls, num_nodes: np.ndarray, num_edges: np.ndarray, batch_size: int) -> "BatchPadding":
        """The smallest padding that fits any ``batch_size`` of the graphs: the largest node count and
        the sum of the ``batch_size`` largest edge counts."""
        if len(num_nodes) == 0:
            raise ValueError("cannot size a padding for an empty split")
        edges = np.sort(np.asarray(num_edges, dtype=np.int64))[::-1][:batch_size]
        return cls(int(np.max(num_nodes)), int(edges.sum()))

    def check(self, max_nodes: int, total_edges: int, num_graphs: int = 0) -> None:
        """ValueError unless a batch of ``max_nodes`` (N) and ``total_edges`` (E) fits."""
        if max_nodes > self.num_nodes or total_edges > self.num_edges:
            raise ValueError(f"a batch of {num_graphs} graphs with N={max_nodes} nodes per graph and "
                             f"E={total_edges} edges does not fit the padding N={self.num_nodes}, "
                             f"E={self.num_edges}")


def _ragged_positions(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(owner, local)`` of each element of ragged rows of lengths ``counts``."""
    owner = np.repeat(np.arange(counts.size), counts)
    starts = np.cumsum(counts) - counts
    local = np.arange(owner.size) - starts[owner]
    return owner, local


def collate(graphs: FlatGraphs, indices: Sequence[int] | np.ndarray, y: np.ndarray | None = None,
            positions: np.ndarray | None = None, padding: BatchPadding | None = None,
            descriptors: np.ndarray | None = None) -> GraphBatch:
    """Gather graphs ``indices`` (any order, repeats allowed) into a padded batch (:class:`GraphBatch`);
    ``y`` and ``positions`` override ``graphs.y[indices]`` and ``indices`` where several rows share
    one stored graph, ``padding`` fixes ``N`` and ``E``."""
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

    # Node pairs: one slice copy per graph of its contiguous [n, n, *S] block.
    sizes, pair_start = n.tolist(), graphs.pair_ptr[index].tolist()
    for enc, stored in graphs.specs():
        if enc.per != "pair":
            continue
        # a plain view: slicing np.memmap itself costs its subclass hooks on every block
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


@functools.cache
def _torch_dtype(dtype) -> torch.dtype:
    return torch.from_numpy(np.zeros(0, dtype=dtype)).dtype


def gather_batch(graphs: FlatGraphs, index: Tensor, y: Tensor | None = None,
                 positions: Tensor | None = None, padding: BatchPadding | None = None,
                 check_padding: bool = True) -> GraphBatch:
    r"""The torch twin of :func:`collate` on ``graphs.device`` (the same :class:`GraphBatch`, bit for
    bit). ``padding`` default: the batch's own sizes (one device-to-host sync); it is checked (one
    sync) unless ``check_padding`` is False, as a recorded step needs. Every intermediate has a fixed
    shape (dense grids and masks, edge owners by ``searchsorted`` of the running edge counts), so the
    gather can be captured in a CUDA graph."""
    device = graphs.device
    index = index.to(device=device, dtype=torch.int64)
    node_start = graphs.node_ptr.index_select(0, index)
    n = graphs.node_ptr.index_select(0, index + 1) - node_start
    edge_start = graphs.edge_ptr.index_select(0, index)
    m = graphs.edge_ptr.index_select(0, index + 1) - edge_start
    if padding is None or check_padding:
        max_nodes, total_edges = (int(n.max()), int(m.sum())) if len(index) else (0, 0)
        if padding is None:
            padding = BatchPadding(max_nodes, total_edges)
        padding.check(max_nodes, total_edges, len(index))
    big_n, big_e = padding.num_nodes, padding.num_edges
    y = graphs.y.index_select(0, index) if y is None else y
    positions = index if positions is None else positions
    b = len(index)

    local = torch.arange(big_n, device=device)
    node_real = local < n[:, None]  # [B, N]
    node_src = torch.where(node_real, node_start[:, None] + local, 0).view(-1)
    real_rows = node_real.view(-1, 1)
    x = torch.where(real_rows, graphs.x.index_select(0, node_src), 0).to(torch.int32)
    encoded = {}
    for enc, stored in graphs.specs():
        if enc.per != "node":
            continue
        values = stored.index_select(0, node_src).to(_torch_dtype(enc.batch_dtype))
        encoded[enc.name] = torch.where(real_rows.view(-1, *[1] * (values.dim() - 1)), values,
                                        enc.fill).view(b, big_n, *stored.shape[1:])

    edge_end = torch.cumsum(m, 0)  # o_b + m_b
    edge_offset = edge_end - m  # o_b: first batch row of graph b's edges
    rows = torch.arange(big_e, device=device)
    edge_owner = torch.searchsorted(edge_end, rows, right=True).clamp_(max=b - 1)
    edge_real = rows < edge_end[-1]
    edge_src = torch.where(edge_real, edge_start.index_select(0, edge_owner) + rows
                           - edge_offset.index_select(0, edge_owner), 0)
    edge_attr = torch.zeros((big_e + 1, graphs.edge_attr.shape[1]), dtype=torch.int32, device=device)
    edge_attr[:big_e] = torch.where(edge_real[:, None], graphs.edge_attr.index_select(0, edge_src), 0)

    pair_real = node_real[:, :, None] & node_real[:, None, :]  # [B, N, N]
    pair_src = graphs.pair_ptr.index_select(0, index)[:, None, None] + local[:, None] * n[:, None, None] + local
    pair_src = torch.where(pair_real, pair_src, 0).view(-1)
    for enc, stored in graphs.specs():
        if enc.per != "pair":
            continue
        row_dims = stored.dim() - 1
        values = stored.index_select(0, pair_src).to(_torch_dtype(enc.batch_dtype))
        values = values.view(b, big_n, big_n, *stored.shape[1:])
        if enc.edge_ids:  # local -> batch edge row; -1 stays -1
            offset = edge_offset.to(values.dtype).view(b, 1, 1, *[1] * row_dims)
            values = torch.where(values >= 0, values + offset, values)
        encoded[enc.name] = torch.where(pair_real.view(b, big_n, big_n, *[1] * row_dims), values, enc.fill)

    return GraphBatch(
        x=x.view(b, big_n, -1),
        node_mask=node_real,
        encodings={name: encoded[name] for name in graphs.encodings},
        edge_attr=edge_attr,
        y=y.to(torch.float32),
        num_nodes=n.to(torch.int32),
        index=positions.to(torch.int64),
    )


def collate_pyg_graphs(data_list: Sequence, params: EncodingParams | int, atom_feature_dims: Sequence[int],
                       bond_feature_dims: Sequence[int]) -> GraphBatch:
    """Encode (in memory, :class:`~.pyg.GraphormerEncodings`) and collate a few
    ``torch_geometric.data.Data`` graphs (raw ``x``, ``edge_index``, ``edge_attr``, optional
    ``y``): small inputs and test fixtures. ``params`` may be just ``max_hops``."""
    from torch_geometric.data import Batch

    from graphormer_urpe.data.pyg import GraphormerEncodings, to_graph_batch

    if not isinstance(params, EncodingParams):
        params = EncodingParams(max_hops=params)
    if len(data_list) == 0:
        raise ValueError("collate_pyg_graphs needs at least one graph")
    encode = GraphormerEncodings(**params.as_dict())
    batch = Batch.from_data_list([encode(data.clone()) for data in data_list])
    return to_graph_batch(batch, atom_feature_dims, bond_feature_dims)

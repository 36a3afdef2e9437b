r"""Device-resident data: a whole split's encoded graphs on one device, batches gathered there.

With ``GraphDataModule(device_resident=True)`` the loaders are :class:`ResidentLoader` objects: each
split's :class:`~.collate.FlatGraphs` is copied once to the trainer's device (GPU memory for a
GPU run) and every batch is gathered there by :func:`gather_batch`, a fully vectorised torch
version of :func:`~.collate.collate`. A training step then costs no Python per graph, no
``DataLoader`` worker and no host-to-device copy of the batch; only ``B`` int64 item ids per step
are sliced from the epoch order that is moved to the device once per epoch.

Ragged arithmetic of :func:`gather_batch` for graphs ``index [B]`` with node counts ``n_b``,
edge counts ``m_b`` and ``N = max_b n_b``:

.. math::
    \text{node } (b, i):& \quad \text{src } = \text{node\_ptr}[g_b] + i, \quad
        \text{dst } = b N + i, \qquad 0 \le i < n_b \\
    \text{edge } (b, e):& \quad \text{src } = \text{edge\_ptr}[g_b] + e, \quad
        \text{dst } = o_b + e, \quad o_b = \textstyle\sum_{b' < b} m_{b'} \\
    \text{pair } (b, i, j):& \quad \text{src } = \text{pair\_ptr}[g_b] + i n_b + j, \quad
        \text{dst } = b N^2 + i N + j

with each element's owner ``b`` and local position from ``repeat_interleave`` / ``cumsum``
(:func:`ragged_positions`). Path edges (stored as local edge ids) get ``+ o_b``; ``-1`` stays
``-1``, the all-zero last row of ``edge_attr``.

With a fixed padding (:class:`~.batch.BatchPadding`) :func:`gather_batch` gathers the padded
batch with every intermediate of a fixed shape instead (dense grids and masks, no ragged
positions), as a training step recorded in a CUDA graph needs (:mod:`graphormer_urpe.training.engine`).

Two implementations, one contract: the numpy :func:`~.collate.collate` stays the CPU
``DataLoader`` path because its per-graph block copies of the pair arrays run faster on one
core than these element-wise gathers (docs/benchmarks.md) and read memory-mapped storage without copying it; ``tests/data/test_resident.py`` asserts both give
identical batches on real ZINC.
"""
from __future__ import annotations

import functools
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, fields

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Sampler

from graphormer_urpe.data.batch import BatchPadding, GraphBatch
from graphormer_urpe.data.collate import FlatGraphs, GraphArrays
from graphormer_urpe.data.dataset import EncodedGraphDataset, SeededShuffleSampler, unmasked


@functools.cache
def _torch_dtype(dtype) -> torch.dtype:
    """The torch dtype of a numpy dtype."""
    return torch.from_numpy(np.zeros(0, dtype=dtype)).dtype


def _as_tensor(array: np.ndarray, device: torch.device) -> Tensor:
    """A numpy array (possibly a read-only memory map) as a tensor on ``device``, dtype kept."""
    with warnings.catch_warnings():  # read-only maps: torch warns about writes we never make
        warnings.simplefilter("ignore", UserWarning)
        tensor = torch.from_numpy(np.asarray(array))
    return tensor.to(device, copy=device.type == "cpu")  # a CPU copy detaches from the map


@dataclass(frozen=True)
class TensorGraphs(GraphArrays[Tensor]):
    """:class:`~.collate.FlatGraphs` as torch tensors on one device (same fields, same compact
    dtypes; see :class:`~.collate.GraphArrays` for shapes)."""

    @classmethod
    def from_flat(cls, graphs: FlatGraphs, device: torch.device | str = "cpu") -> "TensorGraphs":
        device = torch.device(device)
        return cls(**{f.name: _as_tensor(getattr(graphs, f.name), device) for f in fields(cls) if f.name != "encodings"},
                   encodings={name: _as_tensor(values, device) for name, values in graphs.encodings.items()})

    @property
    def device(self) -> torch.device:
        return self.x.device


@dataclass(frozen=True)
class BatchShape:
    """Host-side sizes of one batch, so the device gather needs no device-to-host sync."""

    num_graphs: int
    max_nodes: int  # N
    total_nodes: int  # sum n_b
    total_edges: int  # sum m_b
    total_pairs: int  # sum n_b^2

    @classmethod
    def of(cls, num_nodes: np.ndarray | Tensor, num_edges: np.ndarray | Tensor) -> "BatchShape":
        """From the batch's node counts ``[B]`` and edge counts ``[B]`` (host arrays are free;
        device tensors cost a sync)."""
        n, m = (np.asarray(c.cpu() if isinstance(c, Tensor) else c, dtype=np.int64)
                for c in (num_nodes, num_edges))
        if len(n) == 0:
            return cls(0, 0, 0, 0, 0)
        return cls(len(n), int(n.max()), int(n.sum()), int(m.sum()), int((n * n).sum()))


def ragged_positions(counts: Tensor, total: int) -> tuple[Tensor, Tensor]:
    """For ragged rows of lengths ``counts [B]`` (``total`` = their sum, given so no sync is
    needed): ``(owner, local)``, each ``[total]`` int64, the row of each element and its position
    inside that row."""
    owner = torch.repeat_interleave(torch.arange(len(counts), device=counts.device), counts,
                                    output_size=total)
    starts = torch.cumsum(counts, 0) - counts
    local = torch.arange(total, device=counts.device) - starts.index_select(0, owner)
    return owner, local


def gather_batch(graphs: TensorGraphs, index: Tensor, y: Tensor | None = None,
                 positions: Tensor | None = None, shape: BatchShape | None = None,
                 padding: BatchPadding | None = None, check_padding: bool = True) -> GraphBatch:
    """Gather graphs ``index [B]`` (int64, on ``graphs.device``) into a padded batch, on that device.

    The torch twin of :func:`~.collate.collate` (same :class:`GraphBatch`, bit for bit).
    ``y [B, T]`` / ``positions [B]`` override ``graphs.y[index]`` / ``GraphBatch.index``
    (default: ``index``). ``shape`` (from host-side counts, :meth:`BatchShape.of`) avoids the
    one device-to-host sync that sizing the outputs otherwise needs.

    ``padding`` fixes ``N`` and ``E`` (:class:`~.batch.BatchPadding`): the batch is then gathered
    with every intermediate of a fixed shape (:func:`_gather_padded`), as a step recorded in a
    CUDA graph needs. The graphs must fit the padding: checked (from ``shape``, else with one
    sync) unless ``check_padding`` is False, for a caller whose padding covers the whole split
    (:meth:`~.batch.BatchPadding.covering`) and which must not sync (a recorded step).
    """
    device = graphs.device
    index = index.to(device=device, dtype=torch.int64)
    node_start = graphs.node_ptr.index_select(0, index)
    n = graphs.node_ptr.index_select(0, index + 1) - node_start
    edge_start = graphs.edge_ptr.index_select(0, index)
    m = graphs.edge_ptr.index_select(0, index + 1) - edge_start
    if shape is None and (padding is None or check_padding):
        shape = BatchShape.of(n, m)
    if shape is not None and shape.num_graphs != len(index):
        raise ValueError(f"shape is for {shape.num_graphs} graphs but index has {len(index)}")
    if padding is not None:
        if check_padding:
            padding.check(shape.max_nodes, shape.total_edges, len(index))
        return _gather_padded(graphs, index, n, node_start, m, edge_start, padding, y, positions)
    b, big_n, edge_rows = shape.num_graphs, shape.max_nodes, shape.total_edges

    # Nodes: destination b * N + local in a [B * N] grid.
    node_owner, node_local = ragged_positions(n, shape.total_nodes)
    node_src = node_start.index_select(0, node_owner) + node_local
    node_dst = node_owner * big_n + node_local
    x = torch.zeros((b * big_n, graphs.x.shape[1]), dtype=torch.int32, device=device)
    x.index_copy_(0, node_dst, graphs.x.index_select(0, node_src).to(torch.int32))
    node_mask = torch.zeros(b * big_n, dtype=torch.bool, device=device)
    node_mask.index_fill_(0, node_dst, True)
    encoded = {}
    for enc, stored in graphs.specs():
        if enc.per == "node":
            values = torch.full((b * big_n, *stored.shape[1:]), enc.fill, dtype=_torch_dtype(enc.batch_dtype),
                                device=device)
            values.index_copy_(0, node_dst, stored.index_select(0, node_src).to(values.dtype))
            encoded[enc.name] = values.view(b, big_n, *stored.shape[1:])

    # Edges: concatenated, plus the all-zero row that path edge -1 resolves to.
    edge_owner, edge_local = ragged_positions(m, shape.total_edges)
    edge_attr = torch.zeros((edge_rows + 1, graphs.edge_attr.shape[1]), dtype=torch.int32, device=device)
    edge_attr[:shape.total_edges] = graphs.edge_attr.index_select(0, edge_start.index_select(0, edge_owner) + edge_local)
    edge_offset = (torch.cumsum(m, 0) - m).to(torch.int32)  # first batch row of each graph's edges

    # Node pairs: local pair p = i * n_b + j of graph b goes to b * N^2 + i * N + j.
    pair_owner, pair_local = ragged_positions(n * n, shape.total_pairs)
    pair_src = graphs.pair_ptr.index_select(0, index).index_select(0, pair_owner) + pair_local
    owner_n = n.index_select(0, pair_owner)
    row = torch.div(pair_local, owner_n, rounding_mode="floor")
    pair_dst = pair_owner * (big_n * big_n) + row * big_n + (pair_local - row * owner_n)
    for enc, stored in graphs.specs():
        if enc.per != "pair":
            continue
        values = stored.index_select(0, pair_src).to(_torch_dtype(enc.batch_dtype))
        if enc.edge_ids:  # local -> batch edge row; -1 stays -1 (x >> 31 is -1 iff x < 0, so the mask is 0)
            values += edge_offset.index_select(0, pair_owner).view(-1, *[1] * (values.dim() - 1)) & ~(values >> 31)
        padded = torch.full((b * big_n * big_n, *stored.shape[1:]), enc.fill, dtype=values.dtype, device=device)
        padded.index_copy_(0, pair_dst, values)
        encoded[enc.name] = padded.view(b, big_n, big_n, *stored.shape[1:])

    return GraphBatch(
        x=x.view(b, big_n, -1),
        node_mask=node_mask.view(b, big_n),
        encodings={name: encoded[name] for name in graphs.encodings},
        edge_attr=edge_attr,
        y=(graphs.y.index_select(0, index) if y is None else y).to(torch.float32),
        num_nodes=n.to(torch.int32),
        index=index if positions is None else positions.to(torch.int64),
    )


def _gather_padded(graphs: TensorGraphs, index: Tensor, n: Tensor, node_start: Tensor, m: Tensor,
                   edge_start: Tensor, padding: BatchPadding, y: Tensor | None,
                   positions: Tensor | None) -> GraphBatch:
    r""":func:`gather_batch` into ``padding`` with every intermediate of a fixed shape, so it can
    be captured in a CUDA graph: ``B = len(index)`` graphs, ``N``, ``E`` from ``padding``, no size
    read from the data (no device-to-host sync, no ``repeat_interleave``); ``n``, ``m`` are the
    graphs' node and edge counts, starting at ``node_start``, ``edge_start``.

    Instead of ragged positions it walks the dense grids and masks: node ``(b, i)`` is real iff
    ``i < n_b``, pair ``(b, i, j)`` iff ``i, j < n_b`` (source ``pair_ptr[g_b] + i n_b + j``), and
    edge row ``r < E`` belongs to the graph ``b`` with ``o_b \le r < o_b + m_b``
    (``searchsorted`` of the running edge counts). The graphs must fit the padding (the caller
    checks that).
    """
    device = graphs.device
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


@dataclass
class OrderSlice:
    """A training batch by its place in the epoch's order: items ``order[start:start + size]``
    (``order`` is one device tensor per epoch), which the training step gathers itself
    (:meth:`ResidentSplit.gather`), inside a recorded CUDA graph on a GPU
    (:mod:`graphormer_urpe.training.engine`). What a :class:`ResidentLoader` with
    ``static_shapes`` yields. A plain dataclass: Lightning moves its tensor field to the device,
    where ``order`` already is (the same tensor comes back)."""

    order: Tensor
    start: int
    size: int

    @property
    def num_graphs(self) -> int:
        return self.size


class ResidentSplit:
    """The items of one split (an :class:`~.dataset.EncodedGraphDataset`) on a device.

    Item ids, targets and positions live on the device next to the graphs; node and edge
    counts per item stay on the host as well, to size each batch without a sync.
    ``graphs`` may be shared by several splits (PCQM4Mv2 and CSV stores hold all molecules).
    """

    def __init__(self, dataset: EncodedGraphDataset, graphs: TensorGraphs) -> None:
        device = graphs.device
        self.graphs = graphs
        self.graph_ids = torch.as_tensor(dataset.graph_ids, dtype=torch.int64).to(device)
        self.y = torch.as_tensor(dataset.y, dtype=torch.float32).to(device)
        self.positions = torch.as_tensor(dataset.positions, dtype=torch.int64).to(device)
        self.num_nodes = dataset.num_nodes
        self.num_edges = dataset.num_edges
        self.padding = dataset.padding  # as the dataset's own batches (``__getitems__``)

    @property
    def device(self) -> torch.device:
        return self.graphs.device

    def __len__(self) -> int:
        return len(self.num_nodes)

    def batch(self, items: np.ndarray, items_on_device: Tensor | None = None) -> GraphBatch:
        """The batch of items ``items [B]`` (host ints), padded as the dataset's batches are;
        ``items_on_device`` is the same ids already on the device (saves a host-to-device copy)."""
        items, unlabelled = unmasked(items)  # masked: served without labels, as the dataset does
        if unlabelled.any():
            items_on_device = None
        if items_on_device is None:
            items_on_device = torch.from_numpy(items).to(self.device, non_blocking=True)
        shape = BatchShape.of(self.num_nodes[items], self.num_edges[items])
        y = self.y.index_select(0, items_on_device)
        positions = self.positions.index_select(0, items_on_device)
        if unlabelled.any():
            keep = ~torch.from_numpy(unlabelled).to(self.device)
            y = torch.where(keep[:, None], y, float("nan"))
            positions = torch.where(keep, positions, -1)
        return gather_batch(self.graphs, self.graph_ids.index_select(0, items_on_device), y, positions,
                            shape, self.padding)

    def gather(self, order: Tensor, start: Tensor | int, offsets: Tensor) -> GraphBatch:
        """The batch of items ``order[start + offsets]`` (device tensors), in the split's padding:
        device work of fixed shapes only, no sync, as a recorded training step needs. The padding
        covers every batch of the split (:meth:`~.batch.BatchPadding.covering`), so it is not
        checked; an :class:`OrderSlice` is ``gather(part.order, part.start, arange(part.size))``."""
        if self.padding is None:
            raise ValueError("gathering from the epoch order needs a split padded to one shape")
        items = order.index_select(0, start + offsets)
        return gather_batch(self.graphs, self.graph_ids.index_select(0, items), self.y.index_select(0, items),
                            self.positions.index_select(0, items), padding=self.padding, check_padding=False)


class ResidentLoader:
    """A ``DataLoader`` stand-in over a :class:`ResidentSplit`: yields batches (:class:`GraphBatch`)
    already on the split's device, ``batch_size`` items each (the last one may be smaller), padded
    as the split's dataset pads them (:class:`~.batch.BatchPadding`).

    ``static_shapes`` (the data's option of that name; the split must be padded to one shape):
    every batch has ``batch_size`` items (an incomplete last one is dropped), so all have one
    shape, and each is yielded as its place in the epoch order (:class:`OrderSlice`), which the
    training step gathers itself (:meth:`ResidentSplit.gather`).

    Items: those of ``sampler`` (any sampler of item ids: a :class:`~.dataset.SeededShuffleSampler`
    for training, which also knows this process's share of a distributed run and where a resumed
    epoch continues; a share of an evaluation split), else the whole split in order. They are drawn
    when iteration starts, as a ``DataLoader`` draws them.
    """

    def __init__(self, split: ResidentSplit, batch_size: int, sampler: Sampler[int] | None = None,
                 static_shapes: bool = False) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if isinstance(sampler, SeededShuffleSampler) and sampler.num_items != len(split):
            raise ValueError(f"sampler covers {sampler.num_items} items but the split has {len(split)}")
        if static_shapes and split.padding is None:
            raise ValueError("static_shapes needs a split padded to one shape")
        self.split = split
        self.batch_size = int(batch_size)
        self.sampler = sampler
        self.batch_sampler = None  # Lightning looks for either, as on a DataLoader
        self.static_shapes = bool(static_shapes)

    def _num_items(self) -> int:
        return len(self.sampler) if self.sampler is not None else len(self.split)

    def __len__(self) -> int:
        if self.static_shapes:
            return self._num_items() // self.batch_size
        return -(-self._num_items() // self.batch_size)

    def order(self) -> np.ndarray:
        """The items of this epoch (this process's share), in order, as int64."""
        if self.sampler is None:
            return np.arange(len(self.split), dtype=np.int64)
        if isinstance(self.sampler, SeededShuffleSampler):
            return self.sampler.shard()
        return np.fromiter(iter(self.sampler), dtype=np.int64)

    def __iter__(self) -> Iterator[GraphBatch | OrderSlice]:
        order = self.order()
        # Resuming inside an epoch: the batches already trained are skipped (the whole epoch's
        # order stays on the device: one tensor of one shape per epoch).
        first = (self.sampler.batches_done() * self.batch_size
                 if isinstance(self.sampler, SeededShuffleSampler) else 0)
        order_on_device = torch.from_numpy(order)
        if self.split.device.type == "cuda":  # pinned, so the copy does not wait for the GPU
            order_on_device = order_on_device.pin_memory()
        order_on_device = order_on_device.to(self.split.device, non_blocking=True)
        end = len(order) // self.batch_size * self.batch_size if self.static_shapes else len(order)
        for start in range(first, end, self.batch_size):
            stop = start + self.batch_size
            if self.static_shapes:
                yield OrderSlice(order_on_device, start, self.batch_size)
            else:
                yield self.split.batch(order[start:stop], order_on_device[start:stop])

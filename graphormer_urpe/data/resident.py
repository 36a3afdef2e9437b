r"""Device-resident data: a whole split's encoded graphs on one device, batches gathered there.

With ``GraphDataModule(device_resident=True)`` the loaders are :class:`ResidentLoader` objects: each
split's :class:`~.collate.FlatGraphs` is copied once to the trainer's device (GPU memory for a
GPU run, :meth:`~.collate.FlatGraphs.to`) and every batch is gathered there by :func:`gather_batch`, a fully vectorised torch
version of :func:`~.collate.collate`. A training step then costs no Python per graph, no
``DataLoader`` worker and no host-to-device copy of the batch; only ``B`` int64 item ids per step
are sliced from the epoch order that is moved to the device once per epoch.

Every batch is gathered with every intermediate of a fixed shape (:func:`gather_batch`), so
the same gather serves an evaluation batch and a training step recorded in a CUDA graph
(:mod:`graphormer_urpe.training.engine`).

Two implementations, one contract: the numpy :func:`~.collate.collate` stays the CPU
``DataLoader`` path because its per-graph block copies of the pair arrays run faster on one
core than these element-wise gathers (docs/benchmarks.md) and read memory-mapped storage
without copying it; ``tests/data/test_resident.py`` asserts both give identical batches on real
ZINC.
"""
from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Sampler

from graphormer_urpe.data.batch import BatchPadding, GraphBatch
from graphormer_urpe.data.collate import FlatGraphs
from graphormer_urpe.data.dataset import EncodedGraphDataset, SeededShuffleSampler, unmasked


@functools.cache
def _torch_dtype(dtype) -> torch.dtype:
    """The torch dtype of a numpy dtype."""
    return torch.from_numpy(np.zeros(0, dtype=dtype)).dtype


def gather_batch(graphs: FlatGraphs, index: Tensor, y: Tensor | None = None,
                 positions: Tensor | None = None, padding: BatchPadding | None = None,
                 check_padding: bool = True) -> GraphBatch:
    r"""Gather graphs ``index [B]`` (int64, on ``graphs.device``) into a padded batch, on that device.

    The torch twin of :func:`~.collate.collate` (same :class:`GraphBatch`, bit for bit).
    ``y [B, T]`` / ``positions [B]`` override ``graphs.y[index]`` / ``GraphBatch.index``
    (default: ``index``). ``padding`` fixes ``N`` and ``E`` (:class:`~.batch.BatchPadding`;
    default: the batch's largest node count and its edge count, read with one device-to-host
    sync). The graphs must fit it: checked (one sync) unless ``check_padding`` is False, for a
    caller that sized it from host-side counts or whose padding covers the whole split
    (:meth:`~.batch.BatchPadding.covering`) and which must not sync (a recorded step).

    Every intermediate has a fixed shape (``B``, ``N``, ``E``; no size read from the data), so
    the gather can be captured in a CUDA graph: it walks the dense grids and masks: node ``(b, i)`` is real iff ``i < n_b``, pair ``(b, i, j)`` iff
    ``i, j < n_b`` (source ``pair_ptr[g_b] + i n_b + j``), and edge row ``r < E`` belongs to the
    graph ``b`` with ``o_b \le r < o_b + m_b`` (``searchsorted`` of the running edge counts). Path edges (local edge ids) get ``+ o_b``;
    ``-1`` stays ``-1``, the all-zero last row of ``edge_attr``.
    """
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

    def __init__(self, dataset: EncodedGraphDataset, graphs: FlatGraphs) -> None:
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
        num_nodes, num_edges = self.num_nodes[items], self.num_edges[items]
        exact = BatchPadding(int(num_nodes.max()), int(num_edges.sum()))
        if self.padding is not None:  # checked here, from the host-side counts: no sync
            self.padding.check(exact.num_nodes, exact.num_edges, len(items))
        y = self.y.index_select(0, items_on_device)
        positions = self.positions.index_select(0, items_on_device)
        if unlabelled.any():
            keep = ~torch.from_numpy(unlabelled).to(self.device)
            y = torch.where(keep[:, None], y, float("nan"))
            positions = torch.where(keep, positions, -1)
        return gather_batch(self.graphs, self.graph_ids.index_select(0, items_on_device), y, positions,
                            self.padding or exact, check_padding=False)

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

r"""Device-resident data: a whole split's encoded graphs copied once to the trainer's device and
every batch gathered there (:func:`~.batch.gather_batch`), so a training step costs no Python per
graph, no ``DataLoader`` worker and no host-to-device copy of the batch."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Sampler

from graphormer_urpe.data.batch import BatchPadding, GraphBatch, gather_batch
from graphormer_urpe.data.graphs import FlatGraphs
from graphormer_urpe.data.dataset import EncodedGraphDataset, SeededShuffleSampler, unmasked


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

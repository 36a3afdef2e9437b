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
    """A training batch by its place in the epoch's order, ``order[start:start + size]`` (one device
    tensor per epoch), which the training step gathers itself (:meth:`ResidentSplit.gather`), inside
    a recorded CUDA graph on a GPU: what a :class:`ResidentLoader` with ``static_shapes`` yields."""

    order: Tensor
    start: int
    size: int

    @property
    def num_graphs(self) -> int:
        return self.size


class ResidentSplit:
    """The items of one split on a device, next to its graphs (which several splits may share); node
    and edge counts stay on the host too, to size each batch without a sync."""

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
        """The batch of host item ids ``items``, padded as the dataset's batches are
        (``items_on_device``: the same ids already on the device)."""
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
        """The batch of items ``order[start + offsets]`` in the split's padding, which covers every batch
        so is not checked: fixed-shape device work, no sync, as a recorded training step needs."""
        if self.padding is None:
            raise ValueError("gathering from the epoch order needs a split padded to one shape")
        items = order.index_select(0, start + offsets)
        return gather_batch(self.graphs, self.graph_ids.index_select(0, items), self.y.index_select(0, items),
                            self.positions.index_select(0, items), padding=self.padding, check_padding=False)


class ResidentLoader:
    """A ``DataLoader`` stand-in over a :class:`ResidentSplit`: batches of ``batch_size`` items of
    ``sampler`` (else the whole split in order), drawn when iteration starts, already on the device.
    With ``static_shapes`` (a split padded to one shape) every batch is whole and yielded as an
    :class:`OrderSlice`."""

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
        if self.sampler is None:
            return np.arange(len(self.split), dtype=np.int64)
        if isinstance(self.sampler, SeededShuffleSampler):
            return self.sampler.shard()
        return np.fromiter(iter(self.sampler), dtype=np.int64)

    def __iter__(self) -> Iterator[GraphBatch | OrderSlice]:
        order = self.order()
        # resuming inside an epoch: the batches already trained are skipped
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

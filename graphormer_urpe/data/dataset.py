"""The items of one split over encoded graphs (:class:`EncodedGraphDataset`, whole batches per
``__getitems__``), and the training order, a pure function of ``(seed, epoch)`` that a resumed
run continues where its checkpoint left it (:class:`SeededShuffleSampler`)."""
from __future__ import annotations

import numbers
from collections.abc import Callable, Iterator, Sequence

import numpy as np
from torch.utils.data import Dataset, DistributedSampler

from graphormer_urpe.data.batch import BatchPadding, GraphBatch, collate
from graphormer_urpe.data.graphs import FlatGraphs


class EncodedGraphDataset(Dataset):
    """The items of one split over a :class:`FlatGraphs` store: item ``i`` is stored graph
    ``graph_ids[i]`` (several items may share one) with targets ``y[i]`` and split position
    ``positions[i]`` (``GraphBatch.index``), defaults: ``i``, that graph's targets and ``i``.
    ``__getitems__`` collates a whole batch, padded to ``padding`` when given; ``descriptors
    [len, D]``: each item's molecule descriptors, which its batches carry."""

    def __init__(self, graphs: FlatGraphs, graph_ids: np.ndarray | None = None,
                 y: np.ndarray | None = None, positions: np.ndarray | None = None,
                 padding: BatchPadding | None = None, descriptors: np.ndarray | None = None) -> None:
        self.graphs = graphs
        self.padding = padding
        self.descriptors = descriptors
        self.graph_ids = np.arange(len(graphs)) if graph_ids is None else np.asarray(graph_ids, dtype=np.int64)
        self.y = (np.asarray(graphs.y[self.graph_ids], dtype=np.float32) if y is None
                  else np.asarray(y, dtype=np.float32).reshape(len(self.graph_ids), -1))
        self.positions = np.arange(len(self.graph_ids)) if positions is None else np.asarray(positions, dtype=np.int64)
        if not len(self.y) == len(self.positions) == len(self.graph_ids):
            raise ValueError(f"graph_ids, y and positions differ in length: "
                             f"{len(self.graph_ids)}, {len(self.y)}, {len(self.positions)}")

    def __len__(self) -> int:
        return len(self.graph_ids)

    @property
    def num_nodes(self) -> np.ndarray:
        return self.graphs.num_nodes[self.graph_ids]

    @property
    def num_edges(self) -> np.ndarray:
        return self.graphs.num_edges[self.graph_ids]

    def subset(self, items: np.ndarray) -> "EncodedGraphDataset":
        """The items ``items`` (keeping their split positions)."""
        return EncodedGraphDataset(self.graphs, self.graph_ids[items], self.y[items], self.positions[items],
                                   self.padding, None if self.descriptors is None else self.descriptors[items])

    def padded(self, padding: BatchPadding | None) -> "EncodedGraphDataset":
        return EncodedGraphDataset(self.graphs, self.graph_ids, self.y, self.positions, padding, self.descriptors)

    def __getitem__(self, item: int) -> GraphBatch:
        return self.__getitems__([item])

    def __getitems__(self, items: Sequence[int]) -> GraphBatch:
        """The batch of ``items``; a :func:`masked` item is served without labels (NaN), at position -1."""
        items, unlabelled = unmasked(items)
        y, positions = self.y[items], self.positions[items]
        if unlabelled.any():
            y, positions = np.where(unlabelled[:, None], np.float32(np.nan), y), np.where(unlabelled, -1, positions)
        return collate(self.graphs, self.graph_ids[items], y, positions, self.padding,
                       None if self.descriptors is None else self.descriptors[items])


def masked(items: np.ndarray) -> np.ndarray:
    """Item ids marked as unlabelled, and back (``~i``, its own inverse): what tops up a process's
    share of an epoch; served with NaN labels, which no loss or metric counts."""
    return ~np.asarray(items, dtype=np.int64)


def unmasked(items: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(item ids with masked ones turned back, which were masked)``."""
    items = np.asarray(items, dtype=np.int64)
    unlabelled = items < 0
    return np.where(unlabelled, masked(items), items), unlabelled


def share(order: np.ndarray, num_replicas: int, rank: int) -> np.ndarray:
    """Process ``rank``'s items of ``order``: every ``num_replicas``-th from ``rank``, uneven shares
    topped up to one length with :func:`masked` items of the order's start."""
    order = np.asarray(order, dtype=np.int64)
    if len(order) % num_replicas:
        whole = order
        order = np.resize(order, -(-len(order) // num_replicas) * num_replicas)
        order[len(whole):] = masked(order[len(whole):])
    return order[rank::num_replicas]


def size_batches(sizes: np.ndarray, batch_size: int, max_pairs: int | None = None) -> list[np.ndarray]:
    """Items sorted by size (stable) and cut into consecutive batches of at most ``batch_size`` and,
    with ``max_pairs``, at most ``max_pairs`` padded node pairs ``len(batch) * (largest + 1)^2`` (a
    larger item alone): training's buckets and prediction's batches."""
    sizes = np.asarray(sizes)
    order = np.argsort(sizes, kind="stable")
    batches, start = [], 0
    while start < len(order):
        end = min(start + batch_size, len(order))
        if max_pairs is not None:  # pairs grow with the batch: its sizes are sorted
            pairs = np.arange(1, end - start + 1) * (sizes[order[start:end]].astype(np.int64) + 1) ** 2
            end = start + max(1, int(np.count_nonzero(pairs <= max_pairs)))
        batches.append(order[start:end])
        start = end
    return batches


class EvaluationSampler(DistributedSampler):
    """Each process's share of an evaluation split, in order (:func:`share`): every item counted once
    and as many batches on every process. A ``DistributedSampler``, so Lightning leaves it as it is."""

    def __init__(self, num_items: int, num_replicas: int, rank: int) -> None:
        super().__init__(range(int(num_items)), num_replicas=num_replicas, rank=rank, shuffle=False)

    def __iter__(self) -> Iterator[int]:
        return iter(share(np.arange(len(self.dataset)), self.num_replicas, self.rank).tolist())


#: numpy's (and ``seed_everything``'s) largest seed.
MAX_SEED = 2**32 - 1


def check_seed(name: str, seed) -> int:
    """``seed`` as an int; one-line ``ValueError`` naming the option outside ``[0, MAX_SEED]``."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"{name} must be an integer from 0 to {MAX_SEED} (2**32 - 1), got {seed!r}")
    return int(seed)


class SeededShuffleSampler(DistributedSampler):
    """A permutation of ``range(num_items)`` that depends only on ``(seed, epoch)``, resumable inside
    an epoch, shared out among the processes of a distributed run.

    The epoch (``current_epoch()``, else the last :meth:`set_epoch`) and the batches of it already
    trained (``batches_done()``) are read when iteration starts, so a resumed run trains on exactly
    the batches an uninterrupted one would. Process ``r`` of ``num_replicas`` takes every
    ``num_replicas``-th item from ``r`` (:meth:`shard`): the processes' ``k``-th batches together
    are the ``k``-th batch of one process at ``num_replicas * batch_size``; uneven shards are topped
    up with :func:`masked` items. ``static_shapes`` keeps only whole global batches.

    With ``sizes`` and ``bucket_batches = w > 0``, windows of ``w`` global batches of the order are
    sorted by size, cut into batches and the full batches shuffled again (an incomplete one last):
    batches of similar-sized graphs, which padding wastes less on."""

    def __init__(self, num_items: int, seed: int = 0, batch_size: int = 1,
                 batches_done: Callable[[], int] | None = None, sizes: np.ndarray | None = None,
                 bucket_batches: int = 0, current_epoch: Callable[[], int | None] | None = None,
                 num_replicas: int = 1, rank: int = 0, static_shapes: bool = False) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must lie in [0, num_replicas={num_replicas}), got {rank}")
        super().__init__(range(int(num_items)), num_replicas=num_replicas, rank=rank, shuffle=False,
                         seed=int(seed), drop_last=static_shapes)
        self.static_shapes = bool(static_shapes)
        self.num_items = int(num_items)
        self.batch_size = int(batch_size)
        self.batches_done = batches_done or (lambda: 0)
        self.current_epoch = current_epoch
        self.bucket_batches = self.check_bucket_batches(bucket_batches)
        if self.bucket_batches and (sizes is None or len(sizes) != self.num_items):
            raise ValueError(f"bucket_batches needs the size of each of the {self.num_items} items, "
                             f"got {None if sizes is None else len(sizes)}")
        self.sizes = None if sizes is None else np.asarray(sizes)

    @staticmethod
    def check_bucket_batches(bucket_batches: int) -> int:
        if int(bucket_batches) < 0:
            raise ValueError(f"bucket_batches must be >= 0, got {bucket_batches}")
        return int(bucket_batches)

    def __len__(self) -> int:
        if self.static_shapes:
            return self.num_items // (self.num_replicas * self.batch_size) * self.batch_size
        return -(-self.num_items // self.num_replicas)

    def permutation(self) -> np.ndarray:
        """This epoch's whole order, ``[num_items]`` int64."""
        epoch = self.current_epoch() if self.current_epoch is not None else None
        epoch = self.epoch if epoch is None else epoch
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(self.num_items)
        if not self.bucket_batches:
            return order
        # in global batches, so each process's share is one of a size-sorted run
        batch = self.batch_size * self.num_replicas
        window = self.bucket_batches * batch
        batches = [order[start:start + window][part] for start in range(0, self.num_items, window)
                   for part in size_batches(self.sizes[order[start:start + window]], batch)]
        full = [b for b in batches if len(b) == batch]  # all but the epoch's last, if incomplete
        return np.concatenate([order[:0], *(full[k] for k in rng.permutation(len(full))), *batches[len(full):]])

    def shard(self) -> np.ndarray:
        """This process's items of the epoch in order, topped up with :func:`masked` ones."""
        order = self.permutation()
        if self.static_shapes:
            order = order[:len(self) * self.num_replicas]
        return share(order, self.num_replicas, self.rank)

    def __iter__(self) -> Iterator[int]:
        return iter(self.shard()[self.batches_done() * self.batch_size:].tolist())

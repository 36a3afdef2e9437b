"""The items of one split over encoded graphs (:class:`EncodedGraphDataset`, whole batches per
``__getitems__``), and the training order, a pure function of ``(seed, epoch)`` that a resumed
run continues where its checkpoint left it (:class:`SeededShuffleSampler`)."""
from __future__ import annotations

import numbers
from collections.abc import Callable, Iterator, Sequence

import numpy as np
from torch.utils.data import Dataset, DistributedSampler

from graphormer_urpe.data.batch import BatchPadding, GraphBatch
from graphormer_urpe.data.batch import collate
from graphormer_urpe.data.graphs import FlatGraphs


class EncodedGraphDataset(Dataset):
    """The items of one split over a :class:`FlatGraphs` store.

    Item ``i`` is stored graph ``graph_ids[i]`` (default ``i``) with targets ``y[i]`` (default
    that graph's) and position ``positions[i]`` in its split (default ``i``; what
    ``GraphBatch.index`` reports, so predictions map back to split order even after filtering).
    Several items may share one stored graph (deduplicated SMILES). ``__getitems__`` collates a
    whole batch in one call, padded to ``padding`` when given (:class:`~.batch.BatchPadding`).
    ``descriptors [len, D]``: each item's molecule descriptors, which its batches carry.
    """

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
        """``[len(self)]`` node count of every item."""
        return self.graphs.num_nodes[self.graph_ids]

    @property
    def num_edges(self) -> np.ndarray:
        """``[len(self)]`` directed edge count of every item."""
        return self.graphs.num_edges[self.graph_ids]

    def subset(self, items: np.ndarray) -> "EncodedGraphDataset":
        """The items ``items`` (keeping their split positions)."""
        return EncodedGraphDataset(self.graphs, self.graph_ids[items], self.y[items], self.positions[items],
                                   self.padding, None if self.descriptors is None else self.descriptors[items])

    def padded(self, padding: BatchPadding | None) -> "EncodedGraphDataset":
        """The same items, their batches padded to ``padding``."""
        return EncodedGraphDataset(self.graphs, self.graph_ids, self.y, self.positions, padding, self.descriptors)

    def __getitem__(self, item: int) -> GraphBatch:
        return self.__getitems__([item])

    def __getitems__(self, items: Sequence[int]) -> GraphBatch:
        """The batch of ``items``; a :func:`masked` item is served without its labels (NaN) and at
        position -1."""
        items, unlabelled = unmasked(items)
        y, positions = self.y[items], self.positions[items]
        if unlabelled.any():
            y, positions = np.where(unlabelled[:, None], np.float32(np.nan), y), np.where(unlabelled, -1, positions)
        return collate(self.graphs, self.graph_ids[items], y, positions, self.padding,
                       None if self.descriptors is None else self.descriptors[items])


def masked(items: np.ndarray) -> np.ndarray:
    """Item ids marked as unlabelled, and back (``~i = -i - 1``, its own inverse): a sampler that
    tops up a process's share of an epoch yields them; the dataset serves them with NaN labels,
    which no loss or metric counts."""
    return ~np.asarray(items, dtype=np.int64)


def unmasked(items: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The item ids of a batch's ``items`` with :func:`masked` ones turned back, and which were
    masked (int64, bool)."""
    items = np.asarray(items, dtype=np.int64)
    unlabelled = items < 0
    return np.where(unlabelled, masked(items), items), unlabelled


def share(order: np.ndarray, num_replicas: int, rank: int) -> np.ndarray:
    """Process ``rank``'s items of ``order``: every ``num_replicas``-th from ``rank``. Where the
    items do not share out evenly, the shares are topped up to one length with items of the
    order's start :func:`masked` (counted in no loss or metric), so every process has as many
    items, and batches, as the others, and no item is counted twice."""
    order = np.asarray(order, dtype=np.int64)
    if len(order) % num_replicas:
        whole = order
        order = np.resize(order, -(-len(order) // num_replicas) * num_replicas)
        order[len(whole):] = masked(order[len(whole):])
    return order[rank::num_replicas]


def size_batches(sizes: np.ndarray, batch_size: int, max_pairs: int | None = None) -> list[np.ndarray]:
    """Items ``0 .. len(sizes) - 1`` sorted by size (stable: equal sizes keep their order) and cut
    into consecutive batches of at most ``batch_size`` and, with ``max_pairs``, at most
    ``max_pairs`` padded node pairs ``len(batch) * (its largest size + 1)^2`` (a larger item
    alone): batches of graphs of similar size, which padding wastes least on. Training's buckets
    (:class:`SeededShuffleSampler`) and prediction's batches
    (:func:`~graphormer_urpe.prediction.model.chunk_batches`)."""
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
    """Each process's share of an evaluation split (validation, test), in the split's order
    (:func:`share`): every item counted once, and as many batches on every process, also for a
    split with fewer items than processes, whose missing items are masked ones. Being a
    ``DistributedSampler``, Lightning leaves it as it is."""

    def __init__(self, num_items: int, num_replicas: int, rank: int) -> None:
        super().__init__(range(int(num_items)), num_replicas=num_replicas, rank=rank, shuffle=False)

    def __iter__(self) -> Iterator[int]:
        return iter(share(np.arange(len(self.dataset)), self.num_replicas, self.rank).tolist())


#: Seeds are numpy's (and Lightning's ``seed_everything``'s): 0 to 2**32 - 1.
MAX_SEED = 2**32 - 1


def check_seed(name: str, seed) -> int:
    """``seed`` as an int; one-line ``ValueError`` naming the option outside ``[0, MAX_SEED]``
    (numpy refuses such a seed only when the first epoch starts)."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"{name} must be an integer from 0 to {MAX_SEED} (2**32 - 1), got {seed!r}")
    return int(seed)


class SeededShuffleSampler(DistributedSampler):
    """A random permutation of ``range(num_items)`` that depends only on ``(seed, epoch)``,
    resumable inside an epoch, and shared out among the processes of a distributed run.

    The epoch (``current_epoch``, a callable: the trainer's epoch; where it is missing or returns
    None, the last :meth:`set_epoch`) and the batches of it already trained (``batches_done``, a callable: 0 at
    an epoch's start, ``k`` when the run resumes from a checkpoint saved after the epoch's
    ``k``-th batch) are read when iteration starts, so a resumed run trains on exactly the
    batches an uninterrupted run would, whatever Lightning told :meth:`set_epoch` meanwhile.

    Several processes (``num_replicas`` > 1, this one ``rank``): process ``r`` takes every
    ``num_replicas``-th item of the epoch's order from ``r`` (:meth:`shard`), so its ``k``-th
    batch of ``batch_size`` and the others' ``k``-th batches together hold exactly the ``k``-th
    batch of one process at ``num_replicas * batch_size``: the same molecules in each step
    whatever the number of processes, and a position in the epoch counted in global batches.
    When the items do not share out evenly, the shards are topped up with items of the epoch's
    start marked as unlabelled (:func:`masked`: they count in no loss), instead of counting
    them twice. With ``static_shapes`` (the data's option) only the whole global batches are
    kept: every batch has ``batch_size`` items.
    Being a ``DistributedSampler``, Lightning leaves it as it is instead of wrapping it in a
    reshuffling one.

    With ``sizes`` (``[num_items]``, e.g. node counts) and ``bucket_batches = w > 0``, batches hold
    graphs of similar size: the random order is cut into windows of ``w`` global batches
    (``num_replicas * batch_size`` items each), each
    window is sorted by size (stable), cut into batches, and the full batches are shuffled again
    (the one incomplete batch, if any, stays last). Every item is still seen once per epoch, but a
    batch padded to its largest graph wastes less: with ``w = 16`` a ZINC batch of 64 has about
    half the node pairs of a random one.
    """

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
        """``bucket_batches`` as an int; ValueError if negative."""
        if int(bucket_batches) < 0:
            raise ValueError(f"bucket_batches must be >= 0, got {bucket_batches}")
        return int(bucket_batches)

    def __len__(self) -> int:
        """This process's items of an epoch."""
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
        # in global batches (all processes' together), so each process's share of one is a share
        # of one size-sorted run, as one process at the global batch would train it
        batch = self.batch_size * self.num_replicas
        window = self.bucket_batches * batch
        batches = [order[start:start + window][part] for start in range(0, self.num_items, window)
                   for part in size_batches(self.sizes[order[start:start + window]], batch)]
        full = [b for b in batches if len(b) == batch]  # all but the epoch's last, if incomplete
        return np.concatenate([order[:0], *(full[k] for k in rng.permutation(len(full))), *batches[len(full):]])

    def shard(self) -> np.ndarray:
        """This process's items of the epoch in order, ``[len(self)]`` int64; items that only top
        up an uneven share are :func:`masked`."""
        order = self.permutation()
        if self.static_shapes:
            order = order[:len(self) * self.num_replicas]
        return share(order, self.num_replicas, self.rank)

    def __iter__(self) -> Iterator[int]:
        return iter(self.shard()[self.batches_done() * self.batch_size:].tolist())

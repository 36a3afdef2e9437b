"""The items of one split over encoded graphs, and the seeded training order.

:class:`EncodedGraphDataset` serves whole batches through ``__getitems__`` (one vectorised
:func:`~.collate.collate` call per batch, no per-graph Python work), padded to the largest graph
of the batch or to a fixed :class:`~.batch.BatchPadding`. :class:`SeededShuffleSampler` makes
the training order a pure function of ``(seed, epoch)``, so a resumed run sees the same order,
and a run resumed inside an epoch continues that epoch's order where the checkpoint left it.
Both serve the ``DataLoader`` path and the device-resident one (:mod:`.resident`).
"""
from __future__ import annotations

import numbers
from collections.abc import Callable, Iterator, Sequence

import numpy as np
from torch.utils.data import Dataset, Sampler

from graphormer_urpe.data.batch import BatchPadding, GraphBatch
from graphormer_urpe.data.collate import FlatGraphs, collate


class EncodedGraphDataset(Dataset):
    """The items of one split over a :class:`FlatGraphs` store.

    Item ``i`` is stored graph ``graph_ids[i]`` (default ``i``) with targets ``y[i]`` (default
    that graph's) and position ``positions[i]`` in its split (default ``i``; what
    ``GraphBatch.index`` reports, so predictions map back to split order even after filtering).
    Several items may share one stored graph (deduplicated SMILES). ``__getitems__`` collates a
    whole batch in one call, padded to ``padding`` when given (:class:`~.batch.BatchPadding`).
    """

    def __init__(self, graphs: FlatGraphs, graph_ids: np.ndarray | None = None,
                 y: np.ndarray | None = None, positions: np.ndarray | None = None,
                 padding: BatchPadding | None = None) -> None:
        self.graphs = graphs
        self.padding = padding
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
                                   self.padding)

    def padded(self, padding: BatchPadding | None) -> "EncodedGraphDataset":
        """The same items, their batches padded to ``padding``."""
        return EncodedGraphDataset(self.graphs, self.graph_ids, self.y, self.positions, padding)

    def __getitem__(self, item: int) -> GraphBatch:
        return self.__getitems__([item])

    def __getitems__(self, items: Sequence[int]) -> GraphBatch:
        items = np.asarray(items, dtype=np.int64)
        return collate(self.graphs, self.graph_ids[items], self.y[items], self.positions[items], self.padding)


#: Seeds are numpy's (and Lightning's ``seed_everything``'s): 0 to 2**32 - 1.
MAX_SEED = 2**32 - 1


def check_seed(name: str, seed) -> int:
    """``seed`` as an int; one-line ``ValueError`` naming the option outside ``[0, MAX_SEED]``
    (numpy refuses such a seed only when the first epoch starts)."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"{name} must be an integer from 0 to {MAX_SEED} (2**32 - 1), got {seed!r}")
    return int(seed)


class SeededShuffleSampler(Sampler[int]):
    """A random permutation of ``range(num_items)`` that depends only on ``(seed, epoch)``,
    resumable inside an epoch.

    Lightning calls :meth:`set_epoch` at every epoch start, so a run resumed at epoch ``e``
    replays the order of an uninterrupted run. ``batches_done`` (a callable) tells how many
    batches of ``batch_size`` items of the current epoch were already trained when iteration
    starts: 0 at an epoch's start, ``k`` when the run resumes from a checkpoint saved after the
    epoch's ``k``-th batch (a validation checkpoint inside the epoch, ``last.ckpt`` of a killed
    run). Iteration then yields the rest of the epoch's order, so the resumed run trains on
    exactly the batches the uninterrupted run would. ``len()`` stays the whole epoch (the
    trainer counts batches from ``k``).

    With ``sizes`` (``[num_items]``, e.g. node counts) and ``bucket_batches = w > 0``, batches hold
    graphs of similar size: the random order is cut into windows of ``w * batch_size`` items, each
    window is sorted by size (stable), cut into batches, and the full batches are shuffled again
    (the one incomplete batch, if any, stays last). Every item is still seen once per epoch, but a
    batch padded to its largest graph wastes less: with ``w = 16`` a ZINC batch of 64 has about
    half the node pairs of a random one.
    """

    def __init__(self, num_items: int, seed: int = 0, batch_size: int = 1,
                 batches_done: Callable[[], int] | None = None, sizes: np.ndarray | None = None,
                 bucket_batches: int = 0) -> None:
        self.num_items = int(num_items)
        self.seed = int(seed)
        self.batch_size = int(batch_size)
        self.batches_done = batches_done or (lambda: 0)
        self.bucket_batches = self.check_bucket_batches(bucket_batches)
        if self.bucket_batches and (sizes is None or len(sizes) != self.num_items):
            raise ValueError(f"bucket_batches needs the size of each of the {self.num_items} items, "
                             f"got {None if sizes is None else len(sizes)}")
        self.sizes = None if sizes is None else np.asarray(sizes)
        self.epoch = 0

    @staticmethod
    def check_bucket_batches(bucket_batches: int) -> int:
        """``bucket_batches`` as an int; ValueError if negative."""
        if int(bucket_batches) < 0:
            raise ValueError(f"bucket_batches must be >= 0, got {bucket_batches}")
        return int(bucket_batches)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.num_items

    def permutation(self) -> np.ndarray:
        """This epoch's whole order, ``[num_items]`` int64."""
        rng = np.random.default_rng([self.seed, self.epoch])
        order = rng.permutation(self.num_items)
        if not self.bucket_batches:
            return order
        window = self.bucket_batches * self.batch_size
        for start in range(0, self.num_items, window):
            part = order[start:start + window]
            order[start:start + window] = part[np.argsort(self.sizes[part], kind="stable")]
        num_full = self.num_items // self.batch_size
        batches = order[:num_full * self.batch_size].reshape(num_full, self.batch_size)
        return np.concatenate([batches[rng.permutation(num_full)].reshape(-1),
                               order[num_full * self.batch_size:]])

    def __iter__(self) -> Iterator[int]:
        return iter(self.permutation()[self.batches_done() * self.batch_size:].tolist())

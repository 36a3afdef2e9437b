"""Lightning DataModules over encoded graphs: a base class and the batching machinery.

Every data family (ZINC, PCQM4Mv2, CSV) turns its splits into :class:`~.collate.FlatGraphs`
(features as shared ids + cached encodings, memory-mapped); :class:`EncodedGraphDataset` then
serves whole batches through ``__getitems__`` (one vectorised :func:`~.collate.collate` call per
batch, no per-graph Python work), padded to the largest graph of the batch.

Training order is a pure function of ``(seed, epoch)`` (:class:`SeededShuffleSampler`), so a
resumed run sees the same order. Graphs with more than ``max_nodes`` nodes are dropped from
TRAINING only (the count is logged); validation, test and prediction serve every graph.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from graphormer_urpe.data.batch import GraphBatch
from graphormer_urpe.data.cache import cached_encodings
from graphormer_urpe.data.collate import FlatGraphs, collate
from graphormer_urpe.data.features import num_embeddings, to_shared_ids
from graphormer_urpe.data.featurize import featurizer_spec

log = logging.getLogger(__name__)

STAGE_SPLITS = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",), "predict": ("predict",)}


def encode_flat_cached(
    x: np.ndarray, node_ptr: np.ndarray, edge_index: np.ndarray, edge_attr: np.ndarray,
    edge_ptr: np.ndarray, y: np.ndarray, *, cache_dir: str | os.PathLike, max_hops: int,
    atom_feature_dims: Sequence[int], bond_feature_dims: Sequence[int], num_threads: int = 1,
) -> FlatGraphs:
    """:class:`FlatGraphs` of raw flat graphs, with encodings from (or stored into) ``cache_dir``.

    ``x [sum n, F]``/``edge_attr [sum E, Fe]`` raw feature values (1-D for one column),
    ``edge_index [2, sum E]`` LOCAL node ids, ``y [G, T]`` or ``[G]``.
    """
    node_ptr = np.asarray(node_ptr, dtype=np.int64)
    encodings = cached_encodings(cache_dir, node_ptr, edge_index, edge_ptr, max_hops, num_threads)
    return FlatGraphs(
        x=to_shared_ids(x, atom_feature_dims, "atom"),
        node_ptr=node_ptr,
        edge_attr=to_shared_ids(edge_attr, bond_feature_dims, "bond"),
        edge_ptr=np.asarray(edge_ptr, dtype=np.int64),
        y=np.asarray(y, dtype=np.float32).reshape(len(node_ptr) - 1, -1),
        spd=encodings["spd"], path_edges=encodings["path_edges"], degree=encodings["degree"],
        pair_ptr=encodings["pair_ptr"],
    )


def flat_graphs_from_pyg(dataset, cache_dir: str | os.PathLike, max_hops: int,
                         atom_feature_dims: Sequence[int], bond_feature_dims: Sequence[int],
                         num_threads: int = 1) -> FlatGraphs:
    """:class:`FlatGraphs` of a PyG ``InMemoryDataset`` straight from its collated storage
    (``_data`` + ``slices``: node ids are already local per graph), no per-graph loop."""
    data, slices = dataset._data, dataset.slices
    if slices is None:  # a dataset of one graph
        slices = {"x": torch.tensor([0, data.num_nodes]), "edge_index": torch.tensor([0, data.edge_index.shape[1]])}
    return encode_flat_cached(
        data.x.numpy(), slices["x"].numpy(), data.edge_index.numpy(), data.edge_attr.numpy(),
        slices["edge_index"].numpy(), data.y.numpy(), cache_dir=cache_dir, max_hops=max_hops,
        atom_feature_dims=atom_feature_dims, bond_feature_dims=bond_feature_dims, num_threads=num_threads,
    )


class EncodedGraphDataset(Dataset):
    """Graphs ``indices`` (default: all) of a :class:`FlatGraphs`; item ``i`` is graph
    ``indices[i]``. ``__getitems__`` collates a whole batch at once; ``GraphBatch.index`` holds the
    graphs' positions in the split (not in this dataset), so predictions map back to the split."""

    def __init__(self, graphs: FlatGraphs, indices: np.ndarray | None = None) -> None:
        self.graphs = graphs
        self.indices = np.arange(len(graphs)) if indices is None else np.asarray(indices, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, position: int) -> GraphBatch:
        return self.__getitems__([position])

    def __getitems__(self, positions: Sequence[int]) -> GraphBatch:
        return collate(self.graphs, self.indices[np.asarray(positions, dtype=np.int64)])


def _already_collated(batch: GraphBatch) -> GraphBatch:
    """DataLoader ``collate_fn``: ``__getitems__`` has already built the batch."""
    return batch


class SeededShuffleSampler(Sampler[int]):
    """A random permutation of ``range(num_items)`` that depends only on ``(seed, epoch)``.

    Lightning calls :meth:`set_epoch` at every epoch start, so a run resumed at epoch ``e``
    replays the order of an uninterrupted run.
    """

    def __init__(self, num_items: int, seed: int = 0) -> None:
        self.num_items = int(num_items)
        self.seed = int(seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.num_items

    def __iter__(self) -> Iterator[int]:
        rng = np.random.default_rng([self.seed, self.epoch])
        return iter(rng.permutation(self.num_items).tolist())


class GraphDataModule(pl.LightningDataModule):
    """Base DataModule: train/val/test/predict loaders over encoded graphs.

    Subclasses set :attr:`featurizer` (the feature vocabularies follow from it) and implement
    :meth:`build` (one-off work: downloads, featurization, encoding caches) and
    :meth:`load_split` (``"train" | "val" | "test" | "predict"`` -> :class:`FlatGraphs`, cheap once
    built), and :attr:`num_targets`.

    Args:
        max_hops: ``K``, path edges kept per node pair (the model's multi-hop edge encoding).
        batch_size: graphs per training batch; ``eval_batch_size`` (default: the same) for the rest.
        num_workers, pin_memory: ``DataLoader`` options.
        max_nodes: training graphs with more nodes are dropped (logged); evaluation keeps all.
        seed: training order seed (with the epoch).
        encode_threads: threads for computing encodings (once per split; cached afterwards).
    """

    featurizer: str = ""
    #: ``"regression"`` or ``"classification"`` (linked into the model by the CLI).
    task: str = "regression"

    def __init__(self, max_hops: int = 5, batch_size: int = 128, num_workers: int = 0,
                 max_nodes: int = 128, seed: int = 0, eval_batch_size: int | None = None,
                 pin_memory: bool = False, encode_threads: int = 1) -> None:
        super().__init__()
        for name, value in (("max_hops", max_hops), ("batch_size", batch_size), ("max_nodes", max_nodes)):
            if int(value) < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.max_hops = int(max_hops)
        self.batch_size = int(batch_size)
        self.eval_batch_size = int(eval_batch_size or batch_size)
        self.num_workers = int(num_workers)
        self.max_nodes = int(max_nodes)
        self.seed = int(seed)
        self.pin_memory = bool(pin_memory)
        self.encode_threads = int(encode_threads)
        self.splits: dict[str, FlatGraphs] = {}

    # Facts linked into the model ---------------------------------------------------------------
    @property
    def atom_feature_dims(self) -> tuple[int, ...]:
        return featurizer_spec(self.featurizer).atom_feature_dims

    @property
    def bond_feature_dims(self) -> tuple[int, ...]:
        return featurizer_spec(self.featurizer).bond_feature_dims

    @property
    def num_atom_embeddings(self) -> int:
        """Atom embedding table size, padding id 0 included."""
        return num_embeddings(self.atom_feature_dims)

    @property
    def num_bond_embeddings(self) -> int:
        """Bond embedding table size, padding id 0 included."""
        return num_embeddings(self.bond_feature_dims)

    @property
    def num_targets(self) -> int:
        raise NotImplementedError

    # Subclass hooks ------------------------------------------------------------------------------
    def build(self) -> None:
        """Make every split loadable (idempotent; cheap when already done)."""
        raise NotImplementedError

    def load_split(self, split: str) -> FlatGraphs:
        raise NotImplementedError

    # Lightning hooks -----------------------------------------------------------------------------
    def prepare_data(self) -> None:
        self.build()

    def setup(self, stage: str | None = None) -> None:
        for split in STAGE_SPLITS.get(stage, ("train", "val", "test")):
            self._split(split)

    def _split(self, split: str) -> FlatGraphs:
        if split not in self.splits:
            self.splits[split] = self.load_split(split)
        return self.splits[split]

    def train_dataset(self) -> EncodedGraphDataset:
        graphs = self._split("train")
        keep = np.flatnonzero(graphs.num_nodes <= self.max_nodes)
        if len(keep) < len(graphs):
            log.warning("dropped %d of %d training graphs with more than max_nodes=%d nodes",
                        len(graphs) - len(keep), len(graphs), self.max_nodes)
        return EncodedGraphDataset(graphs, keep)

    def _loader(self, dataset: EncodedGraphDataset, batch_size: int, sampler: Sampler | None) -> DataLoader:
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, shuffle=False,
                          collate_fn=_already_collated, num_workers=self.num_workers,
                          pin_memory=self.pin_memory, persistent_workers=self.num_workers > 0)

    def train_dataloader(self) -> DataLoader:
        dataset = self.train_dataset()
        return self._loader(dataset, self.batch_size, SeededShuffleSampler(len(dataset), self.seed))

    def val_dataloader(self) -> DataLoader:
        return self._loader(EncodedGraphDataset(self._split("val")), self.eval_batch_size, None)

    def test_dataloader(self) -> DataLoader:
        return self._loader(EncodedGraphDataset(self._split("test")), self.eval_batch_size, None)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(EncodedGraphDataset(self._split("predict")), self.eval_batch_size, None)


def encodings_dir(base: str | os.PathLike, split: str, max_hops: int) -> Path:
    """Where a split's encoding cache lives, next to its processed files."""
    return Path(base) / "encodings" / f"{split}-k{max_hops}"


class ZINCDataModule(GraphDataModule):
    """ZINC (subset: 10,000 / 1,000 / 1,000; full: 220,011 / 24,445 / 5,000) via PyG's ``ZINC``
    under ``<root>/ZINC``, built offline from ``source_dir`` / ``$GRAPHORMER_URPE_ZINC_SOURCE`` when
    its raw files are missing (see :mod:`.zinc`). Prediction serves ``predict_split``."""

    featurizer = "zinc"

    def __init__(self, root: str = "data", subset: bool = True, source_dir: str | None = None,
                 max_hops: int = 5, batch_size: int = 128, num_workers: int = 0, max_nodes: int = 128,
                 seed: int = 0, eval_batch_size: int | None = None, pin_memory: bool = False,
                 encode_threads: int = 1, predict_split: str = "test", build_workers: int | None = None) -> None:
        super().__init__(max_hops=max_hops, batch_size=batch_size, num_workers=num_workers,
                         max_nodes=max_nodes, seed=seed, eval_batch_size=eval_batch_size,
                         pin_memory=pin_memory, encode_threads=encode_threads)
        from graphormer_urpe.data.zinc import SPLITS

        if predict_split not in SPLITS:
            raise ValueError(f"predict_split must be one of {SPLITS}, got {predict_split!r}")
        self.root = Path(root) / "ZINC"
        self.subset = bool(subset)
        self.source_dir = source_dir
        self.predict_split = predict_split
        self.build_workers = build_workers

    @property
    def num_targets(self) -> int:
        return 1

    def build(self) -> None:
        for split in ("train", "val", "test"):
            self.load_split(split)

    def load_split(self, split: str) -> FlatGraphs:
        from graphormer_urpe.data.zinc import load_zinc

        split = self.predict_split if split == "predict" else split
        dataset = load_zinc(self.root, subset=self.subset, split=split, source_dir=self.source_dir,
                            num_workers=self.build_workers)
        return flat_graphs_from_pyg(dataset, encodings_dir(dataset.processed_dir, split, self.max_hops),
                                    self.max_hops, self.atom_feature_dims, self.bond_feature_dims,
                                    self.encode_threads)

"""Lightning DataModules over encoded graphs: a base class and the batching machinery.

Every data family (ZINC, PCQM4M / PCQM4Mv2, CSV) turns its splits into :class:`~.collate.FlatGraphs`
(features as shared ids + cached encodings, memory-mapped); :class:`EncodedGraphDataset` then
serves whole batches through ``__getitems__`` (one vectorised :func:`~.collate.collate` call per
batch, no per-graph Python work), padded to the largest graph of the batch.

Training order is a pure function of ``(seed, epoch)`` (:class:`SeededShuffleSampler`), so a
resumed run sees the same order, and a run resumed inside an epoch continues that epoch's order
where the checkpoint left it. Graphs with more than ``max_nodes`` nodes are dropped from
TRAINING only (the count is logged); validation, test and prediction serve every graph.

``device_resident=True`` swaps each ``DataLoader`` for a :class:`~.resident.ResidentLoader`: the
split on the trainer's device, batches gathered there, same items, order and batches.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from graphormer_urpe.data.batch import BatchPadding, GraphBatch
from graphormer_urpe.data.cache import cached_encodings
from graphormer_urpe.data.collate import FlatGraphs, collate
from graphormer_urpe.data.features import FEATURE_ID_DTYPE, num_embeddings, to_shared_ids
from graphormer_urpe.data.featurize import featurizer_spec
from graphormer_urpe.data.ogb_lsc import PCQM4M, PCQM4MV2, LSCLayout
from graphormer_urpe.data.resident import ResidentLoader, ResidentSplit, TensorGraphs

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


def encode_smiles_store(arrays: dict[str, np.ndarray], cache_dir: str | os.PathLike, max_hops: int,
                        featurizer: str, num_threads: int = 1) -> FlatGraphs:
    """:class:`FlatGraphs` of the distinct molecules of a featurized SMILES table
    (:func:`~.featurize.cached_smiles_graphs`); targets live per row, so the store's ``y`` is NaN.

    The shared feature ids and the encodings are streamed into ONE cache entry ``cache_dir``,
    chunk by chunk (inputs read from the featurized entry's files), keyed by that entry's
    recorded checksums: building or loading a store of any size keeps memory bounded, and the
    returned arrays are all memory-mapped (only ``y``, 4 bytes per molecule, is in memory).
    """
    from graphormer_urpe.data.cache import (
        BLOCK_BYTES, ENCODING_ARRAYS, CacheEntry, cached_entry, encoding_fingerprint, read_rows, write_encodings,
    )

    spec = featurizer_spec(featurizer)
    num_graphs = len(arrays["node_ptr"]) - 1
    y = np.full((num_graphs, 1), np.nan, np.float32)
    if not isinstance(arrays, CacheEntry):  # plain in-memory arrays
        return encode_flat_cached(
            arrays["x"], arrays["node_ptr"], arrays["edge_index"], arrays["edge_attr"], arrays["edge_ptr"], y,
            cache_dir=cache_dir, max_hops=max_hops, atom_feature_dims=spec.atom_feature_dims,
            bond_feature_dims=spec.bond_feature_dims, num_threads=num_threads)
    features = {"x": spec.atom_feature_dims, "edge_attr": spec.bond_feature_dims}
    source = {name: arrays.checksums[name] for name in ("node_ptr", "edge_ptr", "edge_index", *features)}
    fingerprint = {**encoding_fingerprint(max_hops, source), "feature_dims": {k: list(v) for k, v in features.items()}}

    def build(writer) -> None:
        write_encodings(writer, arrays["node_ptr"], arrays["edge_index"], arrays["edge_ptr"], max_hops,
                        num_threads, progress=True)
        for name, dims in features.items():
            raw = arrays[name]
            ids = writer.array(name, FEATURE_ID_DTYPE, raw.shape[1:])
            rows = max(BLOCK_BYTES // max(raw[:1].nbytes, 1), 1)
            for start in range(0, len(raw), rows):
                ids.append(to_shared_ids(read_rows(raw, start, min(start + rows, len(raw))), dims,
                                         "atom" if name == "x" else "bond"))

    encoded = cached_entry(cache_dir, fingerprint, build, expect=(*ENCODING_ARRAYS, *features))
    return FlatGraphs(
        x=encoded["x"], node_ptr=arrays["node_ptr"], edge_attr=encoded["edge_attr"],
        edge_ptr=arrays["edge_ptr"], y=y, spd=encoded["spd"], path_edges=encoded["path_edges"],
        degree=encoded["degree"], pair_ptr=encoded["pair_ptr"],
    )


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


def _already_collated(batch: GraphBatch) -> GraphBatch:
    """DataLoader ``collate_fn``: ``__getitems__`` has already built the batch."""
    return batch


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
        self.bucket_batches = int(bucket_batches)
        if self.bucket_batches < 0:
            raise ValueError(f"bucket_batches must be >= 0, got {bucket_batches}")
        if self.bucket_batches and (sizes is None or len(sizes) != self.num_items):
            raise ValueError(f"bucket_batches needs the size of each of the {self.num_items} items, "
                             f"got {None if sizes is None else len(sizes)}")
        self.sizes = None if sizes is None else np.asarray(sizes)
        self.epoch = 0

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


class GraphDataModule(pl.LightningDataModule):
    """Base DataModule: train/val/test/predict loaders over encoded graphs.

    Subclasses set :attr:`featurizer` (the feature vocabularies follow from it) and implement
    :meth:`build` (one-off work: downloads, featurization, encoding caches) and
    :meth:`load_split` (``"train" | "val" | "test" | "predict"`` -> :class:`EncodedGraphDataset`,
    cheap once built), and :attr:`num_targets`.

    Args:
        max_hops: ``K``, path edges kept per node pair (the model's multi-hop edge encoding).
        batch_size: graphs per training batch; ``eval_batch_size`` (default: the same) for the rest.
        num_workers, pin_memory: ``DataLoader`` options.
        max_nodes: training graphs with more nodes are dropped (logged); evaluation keeps all.
        seed: training order seed (with the epoch).
        encode_threads: threads for computing encodings (once per split; cached afterwards).
        device_resident: keep each split on the trainer's device (``trainer.strategy.root_device``,
            CPU outside a trainer) and gather batches there (:mod:`.resident`); the loaders are
            then :class:`~.resident.ResidentLoader` objects (``num_workers``/``pin_memory`` unused).
        static_shapes: every training batch has the same shape: ``batch_size`` graphs (the last,
            smaller batch of each epoch is dropped), padded to the training split's largest node
            count and to the most edges any ``batch_size`` of its graphs have
            (:meth:`~.batch.BatchPadding.covering`). Needed to capture training steps in CUDA
            graphs (``GraphormerModule(cuda_graphs=True)``); padding changes no loss or gradient.
            Evaluation batches are not padded.
        bucket_batches: train on batches of similar-sized graphs, sorted by node count within
            windows of this many batches of the shuffled order (:class:`SeededShuffleSampler`);
            0 (default) for a plain shuffle. Less padding, so faster steps where the step's cost
            grows with the padded node count (a CPU: ~1.7x for ZINC at 16).
    """

    featurizer: str = ""
    #: ``"regression"`` or ``"classification"`` (linked into the model by the CLI).
    task: str = "regression"

    def __init__(self, max_hops: int = 5, batch_size: int = 128, num_workers: int = 0,
                 max_nodes: int = 128, seed: int = 0, eval_batch_size: int | None = None,
                 pin_memory: bool = False, encode_threads: int = 1, device_resident: bool = False,
                 static_shapes: bool = False, bucket_batches: int = 0) -> None:
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
        self.device_resident = bool(device_resident)
        self.static_shapes = bool(static_shapes)
        self.bucket_batches = int(bucket_batches)
        self.splits: dict[str, EncodedGraphDataset] = {}
        # (host store, its device copy): splits sharing one store (OGB-LSC, CSV) share the copy
        self._resident_graphs: list[tuple[FlatGraphs, TensorGraphs]] = []

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

    def load_split(self, split: str) -> EncodedGraphDataset:
        raise NotImplementedError

    # Lightning hooks -----------------------------------------------------------------------------
    def prepare_data(self) -> None:
        self.build()

    def setup(self, stage: str | None = None) -> None:
        for split in STAGE_SPLITS.get(stage, ("train", "val", "test")):
            self._split(split)

    def _split(self, split: str) -> EncodedGraphDataset:
        if split not in self.splits:
            self.splits[split] = self.load_split(split)
        return self.splits[split]

    def train_dataset(self) -> EncodedGraphDataset:
        dataset = self._split("train")
        keep = np.flatnonzero(dataset.num_nodes <= self.max_nodes)
        if len(keep) < len(dataset):
            log.warning("dropped %d of %d training graphs with more than max_nodes=%d nodes",
                        len(dataset) - len(keep), len(dataset), self.max_nodes)
            dataset = dataset.subset(keep)
        return dataset

    def resident_device(self) -> torch.device:
        """Where device-resident splits live: the trainer's root device, else CPU."""
        trainer = getattr(self, "trainer", None)
        return trainer.strategy.root_device if trainer is not None else torch.device("cpu")

    def _resident_loader(self, dataset: EncodedGraphDataset, batch_size: int,
                         sampler: SeededShuffleSampler | None, drop_last: bool) -> ResidentLoader:
        device = self.resident_device()
        graphs = next((on_device for host, on_device in self._resident_graphs
                       if host is dataset.graphs and on_device.device == device), None)
        if graphs is None:
            graphs = TensorGraphs.from_flat(dataset.graphs, device)
            self._resident_graphs.append((dataset.graphs, graphs))
        trainer = getattr(self, "trainer", None)
        rank, world_size = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        return ResidentLoader(ResidentSplit(dataset, graphs), batch_size, sampler, rank, world_size,
                              drop_last)

    def _loader(self, dataset: EncodedGraphDataset, batch_size: int, sampler: Sampler | None,
                drop_last: bool = False) -> DataLoader | ResidentLoader:
        if self.device_resident:
            return self._resident_loader(dataset, batch_size, sampler, drop_last)
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, shuffle=False,
                          collate_fn=_already_collated, num_workers=self.num_workers, drop_last=drop_last,
                          pin_memory=self.pin_memory, persistent_workers=self.num_workers > 0)

    def batches_done(self) -> int:
        """Batches of the current training epoch already trained (the attached trainer's count,
        restored from a checkpoint when resuming; 0 at an epoch's start or without a trainer)."""
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return 0
        return int(trainer.fit_loop.epoch_loop.batch_progress.current.ready)

    def train_dataloader(self) -> DataLoader | ResidentLoader:
        dataset = self.train_dataset()
        sampler = SeededShuffleSampler(len(dataset), self.seed, self.batch_size, self.batches_done,
                                       dataset.num_nodes, self.bucket_batches)
        if not self.static_shapes:
            return self._loader(dataset, self.batch_size, sampler)
        if len(dataset) < self.batch_size:
            raise ValueError(f"static_shapes drops incomplete batches, but the training split has only "
                             f"{len(dataset)} graphs for batch_size={self.batch_size}")
        padding = BatchPadding.covering(dataset.num_nodes, dataset.num_edges, self.batch_size)
        log.info("static_shapes: training batches of %d graphs padded to N=%d nodes, E=%d edges",
                 self.batch_size, padding.num_nodes, padding.num_edges)
        return self._loader(dataset.padded(padding), self.batch_size, sampler, drop_last=True)

    def val_dataloader(self) -> DataLoader | ResidentLoader:
        return self._loader(self._split("val"), self.eval_batch_size, None)

    def test_dataloader(self) -> DataLoader | ResidentLoader:
        return self._loader(self._split("test"), self.eval_batch_size, None)

    def predict_dataloader(self) -> DataLoader | ResidentLoader:
        return self._loader(self._split("predict"), self.eval_batch_size, None)


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
                 encode_threads: int = 1, predict_split: str = "test", build_workers: int | None = None,
                 device_resident: bool = False, static_shapes: bool = False,
                 bucket_batches: int = 0) -> None:
        super().__init__(max_hops=max_hops, batch_size=batch_size, num_workers=num_workers,
                         max_nodes=max_nodes, seed=seed, eval_batch_size=eval_batch_size,
                         pin_memory=pin_memory, encode_threads=encode_threads,
                         device_resident=device_resident, static_shapes=static_shapes,
                         bucket_batches=bucket_batches)
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

    def load_split(self, split: str) -> EncodedGraphDataset:
        from graphormer_urpe.data.zinc import load_zinc

        split = self.predict_split if split == "predict" else split
        dataset = load_zinc(self.root, subset=self.subset, split=split, source_dir=self.source_dir,
                            num_workers=self.build_workers)
        return EncodedGraphDataset(flat_graphs_from_pyg(
            dataset, encodings_dir(dataset.processed_dir, split, self.max_hops), self.max_hops,
            self.atom_feature_dims, self.bond_feature_dims, self.encode_threads))


class OGBLSCDataModule(GraphDataModule):
    """An OGB-LSC PCQM4M version (:attr:`layout`, see :mod:`.ogb_lsc`) from its official layout
    under ``root``: HOMO-LUMO gap regression on ``ogb`` features. Stages map to OGB splits:
    fit -> train / valid, test -> ``test_split`` (default valid: the test sets have no public
    labels), predict -> ``predict_split`` (default: the first test set; ``GraphBatch.index`` =
    position in that split, the order of OGB's submission file). ``download=True`` fetches OGB's
    archive when the layout is missing. The split dict is checked against the table (rows in
    range, disjoint, labelled where they must be) before anything is served.
    """

    featurizer = "ogb"
    layout: LSCLayout

    def __init__(self, root: str = "data", max_hops: int = 5, batch_size: int = 256, num_workers: int = 0,
                 max_nodes: int = 128, seed: int = 0, eval_batch_size: int | None = None,
                 pin_memory: bool = False, encode_threads: int = 1, test_split: str = "valid",
                 predict_split: str | None = None, build_workers: int | None = None, download: bool = False,
                 device_resident: bool = False, static_shapes: bool = False,
                 bucket_batches: int = 0) -> None:
        super().__init__(max_hops=max_hops, batch_size=batch_size, num_workers=num_workers,
                         max_nodes=max_nodes, seed=seed, eval_batch_size=eval_batch_size,
                         pin_memory=pin_memory, encode_threads=encode_threads,
                         device_resident=device_resident, static_shapes=static_shapes,
                         bucket_batches=bucket_batches)
        splits = self.layout.splits
        predict_split = predict_split or self.layout.test_splits[0]
        for name, value in (("test_split", test_split), ("predict_split", predict_split)):
            if value not in splits:
                raise ValueError(f"{name} must be one of {splits} for {self.layout.name}, got {value!r}")
        self.root = Path(root)
        self.split_names = {"train": "train", "val": "valid", "test": test_split, "predict": predict_split}
        self.build_workers = build_workers
        self.download = bool(download)
        self._store: tuple | None = None

    @property
    def num_targets(self) -> int:
        return 1

    def build(self) -> None:
        self.store()

    def store(self) -> tuple[FlatGraphs, np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        """``(distinct molecules, graph_of_row [R], y [R, 1], split_dict)``, built once."""
        if self._store is None:
            from graphormer_urpe.data import ogb_lsc
            from graphormer_urpe.data.featurize import cached_smiles_graphs, file_fingerprint

            folder = self.layout.path(self.root)
            table = folder / ogb_lsc.RAW_TABLE
            if not table.is_file():
                if not self.download:
                    raise ValueError(f"{self.layout.name} table {table} is missing (expected the OGB-LSC "
                                     "layout; download=True fetches it)")
                ogb_lsc.download(self.root, self.layout)
            splits = ogb_lsc.read_split_dict(self.root, self.layout)
            work = folder / "processed_graphormer_urpe"
            arrays = cached_smiles_graphs(work / "graphs", file_fingerprint(table),
                                          lambda: ogb_lsc.read_table(self.root, self.layout), self.featurizer,
                                          self.build_workers)
            graph_of_row, y = np.asarray(arrays["graph_of_row"]), np.asarray(arrays["y"])
            rejected = np.flatnonzero(graph_of_row < 0)
            if len(rejected):
                raise ValueError(f"{table}: RDKit rejects the SMILES of rows {rejected[:10].tolist()}")
            ogb_lsc.check_split_dict(splits, len(graph_of_row), y.reshape(len(graph_of_row), -1)[:, 0],
                                     folder / ogb_lsc.SPLIT_FILE, self.layout)
            graphs = encode_smiles_store(arrays, encodings_dir(work, "molecules", self.max_hops),
                                         self.max_hops, self.featurizer, self.encode_threads)
            self._store = (graphs, graph_of_row, y, splits)
        return self._store

    def ogb_split(self, name: str) -> EncodedGraphDataset:
        """The rows of OGB split ``name`` (e.g. ``"test-dev"``) in split order."""
        graphs, graph_of_row, y, splits = self.store()
        rows = splits[name]
        return EncodedGraphDataset(graphs, graph_of_row[rows], y[rows])

    def ogb_split_loader(self, name: str) -> DataLoader | ResidentLoader:
        """Evaluation loader (``eval_batch_size``, split order) over OGB split ``name``."""
        return self._loader(self.ogb_split(name), self.eval_batch_size, None)

    def load_split(self, split: str) -> EncodedGraphDataset:
        return self.ogb_split(self.split_names[split])


class PCQM4MDataModule(OGBLSCDataModule):
    """PCQM4M (OGB-LSC 2021, v1): ``<root>/pcqm4m_kddcup2021/`` with splits train / valid / test
    (3,045,360 / 380,670 / 377,423); prediction serves ``test`` by default."""

    layout = PCQM4M


class PCQM4Mv2DataModule(OGBLSCDataModule):
    """PCQM4Mv2: ``<root>/pcqm4m-v2/`` with splits train / valid / test-dev / test-challenge
    (3,378,606 / 73,545 / 147,037 / 147,432); prediction serves ``test-dev`` by default."""

    layout = PCQM4MV2


class CSVDataModule(GraphDataModule):
    """A molecule property CSV (see :mod:`.csv`): ``smiles_column`` + ``target_columns``
    (default: every other column), ``task`` ``regression``, ``classification`` (binary or
    multi-label 0/1 columns) or ``multiclass`` (one column of class ids; ``num_targets`` is the
    number of classes, the largest id + 1), ``split`` random or scaffold with
    ``split_fractions``. Featurized (``ogb``) and encoded once into ``cache_root`` (default
    ``data/csv``), keyed by the file's content. Prediction serves the test split."""

    featurizer = "ogb"

    def __init__(self, path: str, smiles_column: str = "smiles", target_columns: list[str] | None = None,
                 task: str = "regression", split: str = "random",
                 split_fractions: tuple[float, float, float] = (0.8, 0.1, 0.1), cache_root: str = "data/csv",
                 max_hops: int = 5, batch_size: int = 32, num_workers: int = 0, max_nodes: int = 128,
                 seed: int = 0, eval_batch_size: int | None = None, pin_memory: bool = False,
                 encode_threads: int = 1, build_workers: int | None = None,
                 device_resident: bool = False, static_shapes: bool = False,
                 bucket_batches: int = 0) -> None:
        super().__init__(max_hops=max_hops, batch_size=batch_size, num_workers=num_workers,
                         max_nodes=max_nodes, seed=seed, eval_batch_size=eval_batch_size,
                         pin_memory=pin_memory, encode_threads=encode_threads,
                         device_resident=device_resident, static_shapes=static_shapes,
                         bucket_batches=bucket_batches)
        from graphormer_urpe.data import csv as property_csv

        if task not in property_csv.TASKS:
            raise ValueError(f"task must be one of {property_csv.TASKS}, got {task!r}")
        if split not in ("random", "scaffold"):
            raise ValueError(f"split must be 'random' or 'scaffold', got {split!r}")
        self.path = Path(path)
        self.smiles_column = smiles_column
        self.split = split
        self.split_fractions = property_csv.check_fractions(split_fractions)
        self.cache_root = Path(cache_root)
        self.build_workers = build_workers
        self.task = task
        self.target_columns = property_csv.resolve_columns(self.path, smiles_column, target_columns)
        self._store: tuple | None = None
        self._num_classes = None
        if task == "multiclass":  # the model's width is needed before the data is built
            _, y, _ = property_csv.read_property_csv(self.path, smiles_column, self.target_columns)
            usable = np.delete(y, property_csv.nonfinite_target_rows(y), axis=0)
            property_csv.check_targets(self.path, usable, self.target_columns, task)
            self._num_classes = max(int(np.nanmax(usable)) + 1, 2)

    @property
    def num_targets(self) -> int:
        return self._num_classes or len(self.target_columns)

    def build(self) -> None:
        self.store()

    def store(self) -> tuple[FlatGraphs, np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        if self._store is None:
            from graphormer_urpe.data import csv as property_csv
            from graphormer_urpe.data.featurize import cached_smiles_graphs, file_fingerprint

            smiles, y, _ = property_csv.read_property_csv(self.path, self.smiles_column, self.target_columns)
            source = {**file_fingerprint(self.path), "smiles_column": self.smiles_column,
                      "target_columns": self.target_columns}
            work = self.cache_root / f"{self.path.stem}-{source['blake2b'][:12]}"
            arrays = cached_smiles_graphs(work / "graphs", source, lambda: (smiles, y), self.featurizer,
                                          self.build_workers)
            graph_of_row = np.asarray(arrays["graph_of_row"])
            bad_targets = property_csv.nonfinite_target_rows(y)
            property_csv.warn_rejected_rows(self.path, np.flatnonzero(graph_of_row < 0), len(y))
            property_csv.warn_rejected_rows(self.path, bad_targets, len(y),
                                            "with an infinite or out-of-range target")
            usable = graph_of_row >= 0
            usable[bad_targets] = False
            valid = np.flatnonzero(usable)
            if len(valid) == 0:
                raise ValueError(f"{self.path}: no row has a SMILES that RDKit accepts and "
                                 "finite targets")
            property_csv.check_targets(self.path, y[valid], self.target_columns, self.task)
            if self.split == "random":
                parts = property_csv.random_split(len(valid), self.split_fractions, self.seed)
            else:
                parts = property_csv.scaffold_split([smiles[r] for r in valid], self.split_fractions)
            splits = {name: valid[rows] for name, rows in parts.items()}
            graphs = encode_smiles_store(arrays, encodings_dir(work, "molecules", self.max_hops),
                                         self.max_hops, self.featurizer, self.encode_threads)
            self._store = (graphs, graph_of_row, np.asarray(arrays["y"]), splits)
        return self._store

    def load_split(self, split: str) -> EncodedGraphDataset:
        graphs, graph_of_row, y, splits = self.store()
        rows = splits["test" if split == "predict" else split]
        return EncodedGraphDataset(graphs, graph_of_row[rows], y[rows])

    def predict_smiles(self) -> list[str]:
        """The SMILES of the predict split's items, in order (as in the file)."""
        from graphormer_urpe.data import csv as property_csv

        smiles, _, _ = property_csv.read_property_csv(self.path, self.smiles_column,
                                                      self.target_columns)
        return [smiles[row] for row in self.store()[3]["test"]]

"""Lightning DataModules over encoded graphs: a base class, one for SMILES tables, one per dataset.

Every data family (ZINC, PCQM4M / PCQM4Mv2, CSV) turns its splits into :class:`~.collate.FlatGraphs`
(features as shared ids + cached encodings, memory-mapped, :mod:`.encode`); each split is an
:class:`~.dataset.EncodedGraphDataset` that collates whole batches, in the seeded order of
:class:`~.dataset.SeededShuffleSampler` for training. Graphs with more than ``max_nodes`` nodes are
dropped from TRAINING only (the count is logged); validation, test and prediction serve every graph
(a CSV table skips such rows in every split, before featurizing them: :class:`CSVDataModule`).

``device_resident=True`` swaps each ``DataLoader`` for a :class:`~.resident.ResidentLoader`: the
split on the trainer's device, batches gathered there, same items, order and batches.

Adding a dataset: a table of SMILES with targets subclasses :class:`SMILESTableDataModule`
(:meth:`~SMILESTableDataModule.table_source`, :meth:`~SMILESTableDataModule.split_rows`,
:attr:`~GraphDataModule.num_targets`); anything else subclasses :class:`GraphDataModule`
(:meth:`~GraphDataModule.build`, :meth:`~GraphDataModule.load_split`).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler

from graphormer_urpe.algos import MAX_HOPS_LIMIT
from graphormer_urpe.cores import usable_cores
from graphormer_urpe.data.batch import BatchPadding, GraphBatch
from graphormer_urpe.data.collate import FlatGraphs
from graphormer_urpe.data.dataset import EncodedGraphDataset, SeededShuffleSampler, check_seed
from graphormer_urpe.data.encode import encode_smiles_store, flat_graphs_from_pyg
from graphormer_urpe.data.encoding_registry import EncodingParams
from graphormer_urpe.data.facts import DEFAULT_MAX_HOPS
from graphormer_urpe.data.features import num_embeddings
from graphormer_urpe.data.featurize import featurizer_spec
from graphormer_urpe.data.ogb_lsc import PCQM4M, PCQM4MV2, LSCLayout
from graphormer_urpe.data.resident import ResidentLoader, ResidentSplit, TensorGraphs
from graphormer_urpe.files import unreadable_as_a_file

log = logging.getLogger(__name__)

STAGE_SPLITS = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",), "predict": ("predict",)}


def _already_collated(batch: GraphBatch) -> GraphBatch:
    """DataLoader ``collate_fn``: ``EncodedGraphDataset.__getitems__`` has already built the batch."""
    return batch


class GraphDataModule(pl.LightningDataModule):
    """Base DataModule: train/val/test/predict loaders over encoded graphs.

    Subclasses set :attr:`featurizer` (the feature vocabularies follow from it) and implement
    :meth:`build` (one-off work: downloads, featurization, encoding caches) and
    :meth:`load_split` (``"train" | "val" | "test" | "predict"`` -> :class:`EncodedGraphDataset`,
    cheap once built), and :attr:`num_targets`.

    Subclasses take these arguments through ``**kwargs`` (LightningCLI and ``--help`` list them
    with the subclass's own) and restate only those whose default differs.

    Args:
        max_hops: ``K``, path edges kept per node pair (the model's multi-hop edge encoding).
        rwse_steps: random-walk steps of the RWSE node encoding (0: none), which the model embeds
            and adds to the atom features (:mod:`.encoding_registry`).
        batch_size: graphs per training batch; ``eval_batch_size`` (default: the same) for the rest.
        num_workers, pin_memory: ``DataLoader`` options.
        max_nodes: training graphs with more nodes are dropped (logged); evaluation keeps all.
        seed: training order seed (with the epoch).
        encode_threads: threads for computing encodings (once per split; cached afterwards);
            default: every usable core (:func:`graphormer_urpe.cores.usable_cores`).
        build_workers: processes featurizing SMILES (default: every usable core).
        device_resident: keep each split on the trainer's device (``trainer.strategy.root_device``,
            CPU outside a trainer) and gather batches there (:mod:`.resident`); the loaders are
            then :class:`~.resident.ResidentLoader` objects (``num_workers``/``pin_memory`` unused).
        static_shapes: every training batch has the same shape: ``batch_size`` graphs (the last,
            smaller batch of each epoch is dropped), padded to the training split's largest node
            count and to the most edges any ``batch_size`` of its graphs have
            (:meth:`~.batch.BatchPadding.covering`). Needed to capture training steps in CUDA
            graphs (the training engine, with ``device_resident``); padding changes no loss or gradient.
            Evaluation batches are not padded.
        bucket_batches: train on batches of similar-sized graphs, sorted by node count within
            windows of this many batches of the shuffled order (:class:`SeededShuffleSampler`);
            0 (default) for a plain shuffle. Less padding, so faster steps where the step's cost
            grows with the padded node count (Graphormer-slim on ZINC, batch 64, one CPU thread:
            1.46x at 16, docs/results/bench_train_cpu_bucketed.txt).
    """

    featurizer: str = ""
    #: ``"regression"`` or ``"classification"`` (linked into the model by the CLI).
    task: str = "regression"

    def __init__(self, max_hops: int = DEFAULT_MAX_HOPS, batch_size: int = 128, num_workers: int = 0,
                 max_nodes: int = 128, seed: int = 0, eval_batch_size: int | None = None,
                 pin_memory: bool = False, encode_threads: int | None = None, build_workers: int | None = None,
                 device_resident: bool = False, static_shapes: bool = False,
                 bucket_batches: int = 0, rwse_steps: int = 0) -> None:
        super().__init__()
        for name, value in (("max_hops", max_hops), ("batch_size", batch_size), ("max_nodes", max_nodes)):
            if int(value) < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if int(max_hops) > MAX_HOPS_LIMIT:  # the encoder's path arrays hold at most this many hops
            raise ValueError(f"max_hops must be at most {MAX_HOPS_LIMIT}, got {max_hops}")
        #: Every encoding parameter: which encodings the batches carry, their widths, their caches.
        self.encoding_params = EncodingParams(max_hops=int(max_hops), rwse_steps=int(rwse_steps))
        self.batch_size = int(batch_size)
        self.eval_batch_size = int(eval_batch_size or batch_size)
        self.num_workers = int(num_workers)
        self.max_nodes = int(max_nodes)
        self.seed = check_seed("data.init_args.seed", seed)
        self.pin_memory = bool(pin_memory)
        self.encode_threads = usable_cores() if encode_threads is None else int(encode_threads)
        self.build_workers = build_workers
        self.device_resident = bool(device_resident)
        self.static_shapes = bool(static_shapes)
        self.bucket_batches = SeededShuffleSampler.check_bucket_batches(bucket_batches)  # before any build
        self.splits: dict[str, EncodedGraphDataset] = {}
        # (host store, its device copy): splits sharing one store (OGB-LSC, CSV) share the copy
        self._resident_graphs: list[tuple[FlatGraphs, TensorGraphs]] = []

    # Facts linked into the model ---------------------------------------------------------------
    @property
    def max_hops(self) -> int:
        return self.encoding_params.max_hops

    @property
    def node_encodings(self) -> dict[str, int]:
        """``{name: width}`` of the per-node encodings the model embeds (e.g. ``{"rwse": 16}``)."""
        return self.encoding_params.node_encodings()

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
        # Its own generator: a DataLoader draws its workers' base seed when an iterator starts,
        # from the global torch generator if it has none, which would shift the dropout masks of
        # every step after an epoch start or a validation (and so differ after a resume).
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, shuffle=False,
                          collate_fn=_already_collated, num_workers=self.num_workers, drop_last=drop_last,
                          pin_memory=self.pin_memory, persistent_workers=self.num_workers > 0,
                          generator=torch.Generator().manual_seed(self.seed))

    def batches_done(self) -> int:
        """Batches of the current training epoch already trained (the attached trainer's count,
        restored from a checkpoint when resuming; 0 at an epoch's start or without a trainer)."""
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return 0
        return int(trainer.fit_loop.epoch_loop.batch_progress.current.ready)

    def train_dataloader(self) -> DataLoader | ResidentLoader:
        dataset = self.train_dataset()
        sizes = dataset.num_nodes if self.bucket_batches else None  # only bucketing reads them
        sampler = SeededShuffleSampler(len(dataset), self.seed, self.batch_size, self.batches_done,
                                       sizes, self.bucket_batches)
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


class ZINCDataModule(GraphDataModule):
    """ZINC (subset: 10,000 / 1,000 / 1,000; full: 220,011 / 24,445 / 5,000) via PyG's ``ZINC``
    under ``<root>/ZINC``, built offline from ``source_dir`` or the local data copies when its raw
    files are missing (:func:`.zinc.resolve_zinc_source`). Prediction serves ``predict_split``. Other
    arguments: :class:`GraphDataModule`'s."""

    featurizer = "zinc"

    def __init__(self, root: str = "data", subset: bool = True, source_dir: str | None = None,
                 predict_split: str = "test", **kwargs) -> None:
        super().__init__(**kwargs)
        from graphormer_urpe.data.zinc import SPLITS

        if predict_split not in SPLITS:
            raise ValueError(f"predict_split must be one of {SPLITS}, got {predict_split!r}")
        self.root = Path(root) / "ZINC"
        self.subset = bool(subset)
        self.source_dir = source_dir
        self.predict_split = predict_split

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
            dataset, (dataset.processed_dir, split), self.encoding_params,
            self.atom_feature_dims, self.bond_feature_dims, self.encode_threads))


#: ``(molecules, graph_of_row [R], y [R, T], {table split: rows})`` of a SMILES table.
TableStore = tuple[FlatGraphs, np.ndarray, np.ndarray, dict[str, np.ndarray]]


class SMILESTableDataModule(GraphDataModule):
    """A table of molecules, one SMILES and its targets per row: each DISTINCT SMILES is
    featurized (:attr:`featurizer`, ``build_workers`` processes) and encoded once, into cache
    entries under the table's work directory (``graphs/``, ``encodings/molecules-k<K>/``, all
    memory-mapped); splits are row sets of the table, so several rows may share one molecule.

    Subclasses implement :meth:`table_source`, :meth:`split_rows` and :attr:`num_targets`, and
    may set :attr:`split_names` (which table split each stage's split serves). Arguments:
    :class:`GraphDataModule`'s.
    """

    featurizer = "ogb"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        #: The table split each of ``"train" | "val" | "test" | "predict"`` serves.
        self.split_names = {"train": "train", "val": "val", "test": "test", "predict": "test"}
        #: Rows whose SMILES has more atoms are never featurized nor encoded (None: no limit);
        #: their ``graph_of_row`` is ``TOO_LARGE_ROW``.
        self.table_max_atoms: int | None = None
        self._store: TableStore | None = None

    # Subclass hooks ------------------------------------------------------------------------------
    def table_source(self) -> tuple[Path, dict, Callable[[], tuple[Sequence[str], np.ndarray]]]:
        """``(work_dir, source, read)``: where the table's caches live, what its featurized rows
        depend on (e.g. the source file's :func:`~.featurize.file_fingerprint`; a change rebuilds
        them) and ``read() -> (smiles [R], y [R, T])``, called only to (re)build. Checks that the
        source exists (fetching it if the dataset downloads)."""
        raise NotImplementedError

    def split_rows(self, graph_of_row: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
        """``{table split: rows}`` given ``graph_of_row [R]`` (-1 where RDKit rejected the SMILES)
        and ``y [R, T]``; refuses (``ValueError``) or warns about rows that cannot be served."""
        raise NotImplementedError

    # Built once ----------------------------------------------------------------------------------
    def build(self) -> None:
        self.store()

    def store(self) -> TableStore:
        """``(distinct molecules, graph_of_row [R], y [R, T], {table split: rows})``, built once."""
        if self._store is None:
            from graphormer_urpe.data.featurize import cached_smiles_graphs

            work_dir, source, read = self.table_source()
            arrays = cached_smiles_graphs(work_dir / "graphs", source, read, self.featurizer, self.build_workers,
                                          max_atoms=self.table_max_atoms)
            graph_of_row, y = np.asarray(arrays["graph_of_row"]), np.asarray(arrays["y"])
            splits = self.split_rows(graph_of_row, y)
            graphs = encode_smiles_store(arrays, (work_dir, "molecules"), self.encoding_params,
                                         self.featurizer, self.encode_threads)
            self._store = (graphs, graph_of_row, y, splits)
        return self._store

    def table_split(self, name: str) -> EncodedGraphDataset:
        """The rows of table split ``name`` in split order."""
        graphs, graph_of_row, y, splits = self.store()
        rows = splits[name]
        return EncodedGraphDataset(graphs, graph_of_row[rows], y[rows])

    def load_split(self, split: str) -> EncodedGraphDataset:
        return self.table_split(self.split_names[split])


class OGBLSCDataModule(SMILESTableDataModule):
    """An OGB-LSC PCQM4M version (:attr:`layout`, see :mod:`.ogb_lsc`) from its official layout
    under ``root``: HOMO-LUMO gap regression on ``ogb`` features. Stages map to OGB splits:
    fit -> train / valid, test -> ``test_split`` (default valid: the test sets have no public
    labels), predict -> ``predict_split`` (default: the first test set; ``GraphBatch.index`` =
    position in that split, the order of OGB's submission file). ``download=True`` fetches OGB's
    archive when the layout is missing. The split dict is checked against the table (rows in
    range, disjoint, labelled where they must be) before anything is served. Other arguments:
    :class:`GraphDataModule`'s.
    """

    layout: LSCLayout

    def __init__(self, root: str = "data", test_split: str = "valid", predict_split: str | None = None,
                 download: bool = False, batch_size: int = 256, **kwargs) -> None:
        super().__init__(batch_size=batch_size, **kwargs)
        splits = self.layout.splits
        predict_split = predict_split or self.layout.test_splits[0]
        for name, value in (("test_split", test_split), ("predict_split", predict_split)):
            if value not in splits:
                raise ValueError(f"{name} must be one of {splits} for {self.layout.name}, got {value!r}")
        self.root = Path(root)
        self.split_names = {"train": "train", "val": "valid", "test": test_split, "predict": predict_split}
        self.download = bool(download)

    @property
    def num_targets(self) -> int:
        return 1

    def table_source(self) -> tuple[Path, dict, Callable[[], tuple[Sequence[str], np.ndarray]]]:
        from graphormer_urpe.data import ogb_lsc
        from graphormer_urpe.data.featurize import file_fingerprint

        folder = self.layout.path(self.root)
        table = folder / ogb_lsc.RAW_TABLE
        if not table.is_file():
            if not self.download:
                raise ValueError(f"{self.layout.name} table {table} is missing (expected the OGB-LSC "
                                 "layout; download=True fetches it)")
            ogb_lsc.download(self.root, self.layout)
        ogb_lsc.require_layout(self.root, self.layout)  # the split dict too, before featurizing
        ogb_lsc.read_split_dict_checked(self.root, self.layout)  # what needs no table
        return (folder / "processed_graphormer_urpe", file_fingerprint(table),
                lambda: ogb_lsc.read_table(self.root, self.layout))

    def split_rows(self, graph_of_row: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
        from graphormer_urpe.data import ogb_lsc

        folder = self.layout.path(self.root)
        rejected = np.flatnonzero(graph_of_row < 0)
        if len(rejected):
            raise ValueError(f"{folder / ogb_lsc.RAW_TABLE}: RDKit rejects the SMILES of rows "
                             f"{rejected[:10].tolist()}")
        splits = ogb_lsc.read_split_dict(self.root, self.layout)
        ogb_lsc.check_split_dict(splits, len(graph_of_row), y.reshape(len(graph_of_row), -1)[:, 0],
                                 folder / ogb_lsc.SPLIT_FILE, self.layout)
        return splits

    def ogb_split(self, name: str) -> EncodedGraphDataset:
        """The rows of OGB split ``name`` (e.g. ``"test-dev"``) in split order."""
        return self.table_split(name)

    def ogb_split_loader(self, name: str) -> DataLoader | ResidentLoader:
        """Evaluation loader (``eval_batch_size``, split order) over OGB split ``name``."""
        return self._loader(self.ogb_split(name), self.eval_batch_size, None)


class PCQM4MDataModule(OGBLSCDataModule):
    """PCQM4M (OGB-LSC 2021, v1): ``<root>/pcqm4m_kddcup2021/`` with splits train / valid / test
    (3,045,360 / 380,670 / 377,423); prediction serves ``test`` by default."""

    layout = PCQM4M


class PCQM4Mv2DataModule(OGBLSCDataModule):
    """PCQM4Mv2: ``<root>/pcqm4m-v2/`` with splits train / valid / test-dev / test-challenge
    (3,378,606 / 73,545 / 147,037 / 147,432); prediction serves ``test-dev`` by default."""

    layout = PCQM4MV2


class CSVDataModule(SMILESTableDataModule):
    """A molecule property CSV (see :mod:`.property_csv`): ``smiles_column`` + ``target_columns``
    (default: every other column), ``task`` ``regression``, ``classification`` (binary or
    multi-label 0/1 columns) or ``multiclass`` (one column of class ids; ``num_targets`` is the
    number of classes, the largest id + 1), ``split`` random or scaffold with
    ``split_fractions``, or the rows of a JSON ``split_file`` (:func:`.property_csv.read_split_file`; it
    replaces ``split``: chemprop's ``--splits-file`` reads the same file). Featurized and encoded once into ``cache_root`` (default ``data/csv``),
    keyed by the file's content. ``featurizer``: ``ogb`` (default; any molecule RDKit reads) or
    ``zinc`` (ZINC's 28 atom tokens, to fine-tune a ZINC-trained model; rows with another atom
    are skipped with one warning). Rows whose molecule has more than ``max_nodes`` atoms are
    skipped in every split, counted with the rejected rows (their size is read from the SMILES,
    so a huge polymer is never featurized nor encoded). Prediction serves the test split. Other
    arguments: :class:`GraphDataModule`'s."""

    def __init__(self, path: str, smiles_column: str = "smiles", target_columns: list[str] | None = None,
                 task: str = "regression", split: str = "random",
                 split_fractions: tuple[float, float, float] = (0.8, 0.1, 0.1), cache_root: str = "data/csv",
                 batch_size: int = 32, featurizer: str = "ogb", split_file: str | None = None,
                 **kwargs) -> None:
        super().__init__(batch_size=batch_size, **kwargs)
        from graphormer_urpe.data import property_csv

        if task not in property_csv.TASKS:
            raise ValueError(f"task must be one of {list(property_csv.TASKS)}, got {task!r}")
        if split not in ("random", "scaffold"):
            raise ValueError(f"split must be 'random' or 'scaffold', got {split!r}")
        self.featurizer = featurizer_spec(featurizer).name
        self.path = Path(path)
        self.smiles_column = smiles_column
        self.split = split
        self.split_file = None if split_file is None else Path(split_file)
        if self.split_file is not None:
            problem = unreadable_as_a_file(self.split_file)
            if problem:
                raise ValueError(f"split file {self.split_file} {problem}")
        self.split_fractions = property_csv.check_fractions(split_fractions)
        self.cache_root = Path(cache_root)
        self.task = task
        self.table_max_atoms = self.max_nodes
        self.target_columns = property_csv.resolve_columns(self.path, smiles_column, target_columns)
        self._num_classes = None
        if task == "multiclass":  # the model's width is needed before the data is built
            _, y, _ = self._read()
            usable = np.delete(y, property_csv.nonfinite_target_rows(y), axis=0)
            property_csv.check_targets(self.path, usable, self.target_columns, task)
            self._num_classes = max(int(np.nanmax(usable)) + 1, 2)

    @property
    def num_targets(self) -> int:
        return self._num_classes or len(self.target_columns)

    def _read(self) -> tuple[list[str], np.ndarray, list[str]]:
        from graphormer_urpe.data import property_csv

        return property_csv.read_property_csv(self.path, self.smiles_column, self.target_columns)

    def table_source(self) -> tuple[Path, dict, Callable[[], tuple[Sequence[str], np.ndarray]]]:
        from graphormer_urpe.data.featurize import file_fingerprint

        source = {**file_fingerprint(self.path), "smiles_column": self.smiles_column,
                  "target_columns": self.target_columns}
        # one work directory per featurizer (the ogb one keeps its original name)
        suffix = "" if self.featurizer == "ogb" else f"-{self.featurizer}"
        return (self.cache_root / f"{self.path.stem}-{source['blake2b'][:12]}{suffix}", source,
                lambda: self._read()[:2])

    def split_rows(self, graph_of_row: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
        from graphormer_urpe.data import property_csv
        from graphormer_urpe.data.featurize import REJECTED_ROW, TOO_LARGE_ROW

        bad_targets = property_csv.nonfinite_target_rows(y)
        property_csv.warn_rejected_rows(self.path, np.flatnonzero(graph_of_row == REJECTED_ROW), len(y),
                                        "whose SMILES RDKit rejects" if self.featurizer == "ogb"
                                        else f"whose SMILES RDKit or the {self.featurizer!r} featurizer rejects")
        property_csv.warn_rejected_rows(self.path, np.flatnonzero(graph_of_row == TOO_LARGE_ROW), len(y),
                                        f"with more than max_nodes={self.max_nodes} atoms")
        property_csv.warn_rejected_rows(self.path, bad_targets, len(y),
                                        "with an infinite or out-of-range target")
        usable = graph_of_row >= 0
        usable[bad_targets] = False
        valid = np.flatnonzero(usable)
        if len(valid) == 0:
            raise ValueError(f"{self.path}: no row has a SMILES that RDKit accepts and "
                             "finite targets")
        property_csv.check_targets(self.path, y[valid], self.target_columns, self.task)
        if self.split_file is not None:
            parts = property_csv.read_split_file(self.split_file, len(y))
            for name, rows in parts.items():
                skipped = np.setdiff1d(rows, valid)
                if len(skipped):
                    log.warning("%s: split %r skips %d of its rows whose molecule or target cannot be "
                                "used (rows %s; see above)", self.split_file, name, len(skipped),
                                skipped[:10].tolist())
            return {name: rows[np.isin(rows, valid)] for name, rows in parts.items()}
        if self.split == "random":
            parts = property_csv.random_split(len(valid), self.split_fractions, self.seed)
        else:
            smiles = self._read()[0]
            parts = property_csv.scaffold_split([smiles[r] for r in valid], self.split_fractions)
        return {name: valid[rows] for name, rows in parts.items()}

    def predict_smiles(self) -> list[str]:
        """The SMILES of the predict split's items, in order (as in the file)."""
        smiles, _, _ = self._read()
        return [smiles[row] for row in self.store()[3]["test"]]

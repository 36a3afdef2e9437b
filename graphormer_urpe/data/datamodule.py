"""The base Lightning DataModules over encoded graphs: :class:`GraphDataModule` and, for tables of
SMILES, :class:`SMILESTableDataModule` (adding a data set: docs/data.md). Graphs with more than
``max_nodes`` nodes are dropped from TRAINING only; ``device_resident=True`` swaps each
``DataLoader`` for a :class:`~.resident.ResidentLoader` (same items, order and batches)."""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler

from graphormer_urpe.data.algos import MAX_HOPS_LIMIT
from graphormer_urpe.data.array_store import checksums
from graphormer_urpe.data.batch import BatchPadding, GraphBatch
from graphormer_urpe.data.dataset import EncodedGraphDataset, EvaluationSampler, SeededShuffleSampler, check_seed
from graphormer_urpe.data.graphs import FlatGraphs, encode_smiles_store
from graphormer_urpe.data.encodings import DEFAULT_MAX_HOPS, EncodingParams
from graphormer_urpe.data.feature_ids import num_embeddings
from graphormer_urpe.data.featurize import cached_smiles_graphs, featurizer_spec
from graphormer_urpe.data.resident import ResidentLoader, ResidentSplit
from graphormer_urpe.utils.lightning_private import batches_done
from graphormer_urpe.utils.process import stop_on_signals
from graphormer_urpe.utils.workers import useful_workers

log = logging.getLogger(__name__)

STAGE_SPLITS = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",), "predict": ("predict",)}


def _already_collated(batch: GraphBatch) -> GraphBatch:
    """DataLoader ``collate_fn``: ``EncodedGraphDataset.__getitems__`` has already built the batch."""
    return batch


def _within_cores(name: str, value: int | None) -> int:
    """A count of threads or processes (None: every usable core), at most the usable cores (one
    warning says so); ``ValueError`` below 1."""
    if value is not None and int(value) < 1:
        raise ValueError(f"{name} must be >= 1, or null for every usable core, got {value}")
    count = useful_workers(value)
    if value is not None and int(value) > count:
        log.warning("%s %s is more than the %d cores this process may use: using %d", name, value, count, count)
    return count


class GraphDataModule(pl.LightningDataModule):
    """Base DataModule: train/val/test/predict loaders over encoded graphs. Subclasses set
    :attr:`featurizer` and implement :meth:`build`, :meth:`load_split` and :attr:`num_targets`;
    they take these arguments through ``**kwargs`` and restate only those whose default differs.

    Args:
        max_hops: ``K``, path edges kept per node pair (the model's multi-hop edge encoding).
        rwse_steps: random-walk steps of the RWSE node encoding (0: none), which the model embeds
            and adds to the atom features (:mod:`.encodings`).
        batch_size: graphs per training batch; ``eval_batch_size`` (default: the same) for the rest.
        num_workers, pin_memory: ``DataLoader`` options.
        max_nodes: training graphs with more nodes are dropped (logged); evaluation keeps all.
        seed: training order seed (with the epoch).
        encode_threads: threads for computing encodings (once per split; cached afterwards);
            default: every usable core, and never more.
        build_workers: processes featurizing SMILES (default: every usable core, and never more).
        device_resident: keep each split on the trainer's device (CPU outside a trainer) and gather
            batches there (:mod:`.resident`; ``num_workers``/``pin_memory`` unused).
        static_shapes: every training batch has ``batch_size`` graphs (the last, smaller batch of
            each epoch is dropped), padded to the training split's largest node count and to the
            most edges any ``batch_size`` of its graphs have; with ``device_resident`` training
            steps can be captured in CUDA graphs. Padding changes no loss or gradient; evaluation
            batches are not padded.
        bucket_batches: train on batches of similar-sized graphs, sorted by node count within
            windows of this many batches of the shuffled order; 0 (default): a plain shuffle.
            Less padding, so faster steps where their cost grows with the padded node count."""

    featurizer: str = ""
    #: The task (:data:`~.task.TASKS`), linked into the model by the CLI.
    task: str = "regression"
    #: RDKit descriptors per molecule that the batches carry (0: none), linked into the model.
    num_descriptors: int = 0

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
        self.encode_threads = _within_cores("encode_threads", encode_threads)
        self.build_workers = _within_cores("build_workers", build_workers)
        self.device_resident = bool(device_resident)
        self.static_shapes = bool(static_shapes)
        self.bucket_batches = SeededShuffleSampler.check_bucket_batches(bucket_batches)  # before any build
        self.splits: dict[str, EncodedGraphDataset] = {}
        # (host store, its device copy): splits sharing one store (OGB-LSC, CSV) share the copy
        self._resident_graphs: list[tuple[FlatGraphs, FlatGraphs]] = []

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
        with stop_on_signals(unless_handled=True):  # a stop removes what is half-built
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

    def _loader(self, dataset: EncodedGraphDataset, batch_size: int, sampler: Sampler | None,
                static_shapes: bool = False) -> DataLoader | ResidentLoader:
        if self.device_resident:  # on the trainer's root device, else the CPU
            trainer = getattr(self, "trainer", None)
            device = trainer.strategy.root_device if trainer is not None else torch.device("cpu")
            graphs = next((on_device for host, on_device in self._resident_graphs
                           if host is dataset.graphs and on_device.device == device), None)
            if graphs is None:
                graphs = dataset.graphs.to(device)
                self._resident_graphs.append((dataset.graphs, graphs))
            return ResidentLoader(ResidentSplit(dataset, graphs), batch_size, sampler, static_shapes)
        # Its own generator: a DataLoader draws its workers' base seed when an iterator starts,
        # from the global torch generator if it has none, which would shift the dropout masks of
        # every step after an epoch start or a validation (and so differ after a resume).
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, shuffle=False,
                          collate_fn=_already_collated, num_workers=self.num_workers, drop_last=static_shapes,
                          pin_memory=self.pin_memory, persistent_workers=self.num_workers > 0,
                          generator=torch.Generator().manual_seed(self.seed))

    def batches_done(self) -> int:
        """Batches of the current training epoch already trained (0 without a trainer)."""
        trainer = getattr(self, "trainer", None)
        return 0 if trainer is None else batches_done(trainer)

    def current_epoch(self) -> int | None:
        """The attached trainer's epoch, else None."""
        trainer = getattr(self, "trainer", None)
        return None if trainer is None else trainer.current_epoch

    def processes(self) -> tuple[int, int]:
        """``(rank, number)`` of the processes that train together (1 without a trainer)."""
        trainer = getattr(self, "trainer", None)
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def train_dataloader(self) -> DataLoader | ResidentLoader:
        dataset = self.train_dataset()
        sizes = dataset.num_nodes if self.bucket_batches else None  # only bucketing reads them
        rank, processes = self.processes()
        sampler = SeededShuffleSampler(len(dataset), self.seed, self.batch_size, self.batches_done,
                                       sizes, self.bucket_batches, self.current_epoch, processes, rank,
                                       static_shapes=self.static_shapes)
        if not self.static_shapes:
            loader = self._loader(dataset, self.batch_size, sampler)
        else:
            if len(sampler) == 0:
                raise ValueError(f"static_shapes drops incomplete batches, but the training split has only "
                                 f"{len(dataset)} graphs for batch_size={self.batch_size} on each of "
                                 f"{processes} process(es)")
            padding = BatchPadding.covering(dataset.num_nodes, dataset.num_edges, self.batch_size)
            log.info("static_shapes: training batches of %d graphs padded to N=%d nodes, E=%d edges",
                     self.batch_size, padding.num_nodes, padding.num_edges)
            loader = self._loader(dataset.padded(padding), self.batch_size, sampler, static_shapes=True)
        self._check_val_check_interval(len(loader), len(dataset))
        return loader

    def _check_val_check_interval(self, batches: int, graphs: int) -> None:
        """One-line ``ValueError`` before training when ``val_check_interval`` steps are more than an
        epoch's batches (Lightning refuses it with a traceback once the data is built)."""
        trainer = getattr(self, "trainer", None)
        interval = getattr(trainer, "val_check_interval", None)
        if not isinstance(interval, int) or trainer.check_val_every_n_epoch is None \
                or not trainer.limit_val_batches:
            return
        from graphormer_urpe.utils.lightning_private import limited_batches

        epoch = limited_batches(trainer, batches)
        if interval > epoch:
            raise ValueError(f"--trainer.val_check_interval {interval} is more than the {epoch} training "
                             f"batches of an epoch ({graphs} training graphs, batch_size "
                             f"{self.batch_size}): give at most {epoch}, or add "
                             "--trainer.check_val_every_n_epoch null to count the steps across epochs")

    def _eval_loader(self, split: str) -> DataLoader | ResidentLoader:
        """Split ``split`` in order, each process its share (:class:`~.dataset.EvaluationSampler`)."""
        dataset = self._split(split)
        rank, processes = self.processes()
        sampler = None if processes == 1 else EvaluationSampler(len(dataset), num_replicas=processes, rank=rank)
        return self._loader(dataset, self.eval_batch_size, sampler)

    def val_dataloader(self) -> DataLoader | ResidentLoader:
        return self._eval_loader("val")

    def test_dataloader(self) -> DataLoader | ResidentLoader:
        return self._eval_loader("test")

    def predict_dataloader(self) -> DataLoader | ResidentLoader:
        return self._eval_loader("predict")


#: ``(molecules, graph_of_row [R], y [R, T], {table split: rows})`` of a SMILES table.
TableStore = tuple[FlatGraphs, np.ndarray, np.ndarray, dict[str, np.ndarray]]


class SMILESTableDataModule(GraphDataModule):
    """A table of molecules, one SMILES and its targets per row: each DISTINCT SMILES is featurized
    and encoded once into cache entries under the table's work directory; splits are row sets, so
    several rows may share one molecule. Subclasses implement :meth:`table_source`,
    :meth:`split_rows` and :attr:`num_targets`. Arguments: :class:`GraphDataModule`'s."""

    featurizer = "ogb"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        #: The table split each stage's split serves.
        self.split_names = {"train": "train", "val": "val", "test": "test", "predict": "test"}
        #: Rows whose SMILES has more atoms are never featurized (``TOO_LARGE_ROW``; None: no limit).
        self.table_max_atoms: int | None = None
        self._store: TableStore | None = None

    # Subclass hooks ------------------------------------------------------------------------------
    def table_source(self) -> tuple[Path, dict, Callable[[], tuple[Sequence[str], np.ndarray]]]:
        """``(work_dir, source, read)``: where the table's caches live, what its featurized rows depend
        on (a change rebuilds them) and ``read() -> (smiles [R], y [R, T])``, called only to (re)build."""
        raise NotImplementedError

    def split_rows(self, graph_of_row: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
        """``{table split: rows}`` given ``graph_of_row [R]`` (< 0: no graph) and ``y [R, T]``; refuses
        or warns about rows that cannot be served."""
        raise NotImplementedError

    # Built once ----------------------------------------------------------------------------------
    def build(self) -> None:
        self.store()

    def store(self) -> TableStore:
        """``(distinct molecules, graph_of_row [R], y [R, T], {table split: rows})``, built once."""
        if self._store is None:
            work_dir, source, read = self.table_source()
            arrays = cached_smiles_graphs(work_dir / "graphs", source, read, self.featurizer, self.build_workers,
                                          max_atoms=self.table_max_atoms)
            graph_of_row, y = np.asarray(arrays["graph_of_row"]), np.asarray(arrays["y"])
            splits = self.split_rows(graph_of_row, y)
            graphs = encode_smiles_store(arrays, checksums(work_dir / "graphs"), (work_dir, "molecules"),
                                         self.encoding_params, self.featurizer, self.encode_threads)
            self._store = (graphs, graph_of_row, y, splits)
        return self._store

    def table_split(self, name: str) -> EncodedGraphDataset:
        """The rows of table split ``name`` in split order."""
        graphs, graph_of_row, y, splits = self.store()
        rows = splits[name]
        return EncodedGraphDataset(graphs, graph_of_row[rows], y[rows])

    def load_split(self, split: str) -> EncodedGraphDataset:
        return self.table_split(self.split_names[split])

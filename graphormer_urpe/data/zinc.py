"""ZINC (Benchmarking GNNs) through PyG's own ``torch_geometric.datasets.ZINC``, built offline:
where PyG's archive cannot be fetched, :func:`build_zinc_raw` writes its raw files from a source
directory (docs/data.md, "ZINC offline") and PyG's unchanged ``process()`` takes it from there.

A raw pickle holds one dict per molecule: ``atom_type`` uint8 ``[n]`` (atom-token id),
``bond_type`` uint8 ``[n, n]`` (symmetric, 0 none, 1/2/3 single/double/triple) and
``logP_SA_cycle_normalized`` float32 ``[1]``."""
from __future__ import annotations

import contextlib
import gzip
import io
import json
import logging
import os
import pickle
import urllib.error
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from graphormer_urpe.data.datamodule import GraphDataModule
from graphormer_urpe.data.dataset import EncodedGraphDataset
from graphormer_urpe.data.graphs import flat_graphs_from_pyg
from graphormer_urpe.data.featurize import ZINC_ATOM_TOKENS, map_chunks, smiles_to_zinc_dense
from graphormer_urpe.data.local_data import ZINC as ZINC_DIR, built_under, local_copy, where_to_put
from graphormer_urpe.utils.files import AtomicDirectory

log = logging.getLogger(__name__)

#: Environment variable naming a ZINC source directory outside the local data copies.
ZINC_SOURCE_ENV = "GRAPHORMER_URPE_ZINC_SOURCE"
SPLITS = ("train", "val", "test")
_SOURCE_SPLIT = {"train": "train", "val": "valid", "test": "test"}  # JT-VAE file names
_RAW_FILES = [f"{s}.pickle" for s in SPLITS] + [f"{s}.index" for s in SPLITS]


def _dense_chunk(smiles: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
    from rdkit import RDLogger

    RDLogger.DisableLog("rdApp.*")
    return [smiles_to_zinc_dense(s) for s in smiles]


def zinc_graphs_from_smiles(smiles: Sequence[str], num_workers: int | None = None,
                            chunk_size: int = 2000, desc: str = "ZINC SMILES -> graphs",
                            ) -> list[tuple[np.ndarray, np.ndarray]]:
    """:func:`~.featurize.smiles_to_zinc_dense` over many SMILES in worker processes, in order."""
    return [graph for part in map_chunks(_dense_chunk, smiles, chunk_size, num_workers, desc) for graph in part]


def resolve_zinc_source(source_dir: str | os.PathLike | None = None) -> Path | None:
    """The offline source directory: ``source_dir``, else ``$GRAPHORMER_URPE_ZINC_SOURCE``, else the
    local data copies' ``zinc/``, else None (PyG downloads); ``ValueError`` when it lacks a file."""
    chosen = source_dir
    if chosen is None:
        chosen = os.environ.get(ZINC_SOURCE_ENV) or local_copy(ZINC_DIR)
    if chosen is None:
        return None
    path = Path(chosen)
    needed = ["atom_dict.json"] + [f"jtvae_{_SOURCE_SPLIT[s]}.{ext}" for s in SPLITS for ext in ("smi.gz", "y.gz")]
    needed += [f"subset_{s}.index" for s in SPLITS] + ["subset_val_graphs.npz", "subset_test_graphs.npz"]
    missing = [name for name in needed if not (path / name).is_file()]
    if missing:
        raise ValueError(f"ZINC source directory {path} lacks {', '.join(missing)}")
    return path


def _read_lines(path: Path) -> list[str]:
    with gzip.open(path, "rt") as f:
        return [line.strip() for line in f if line.strip()]


#: The arrays of a ``subset_<split>_graphs.npz`` (the graphs concatenated, with their offsets).
_EXACT_ARRAYS = ("x", "edge_index", "edge_attr", "node_ptr", "edge_ptr", "y")


def _exact_graphs(npz_path: Path) -> list[tuple[np.ndarray, np.ndarray, float]]:
    """The official subset graphs of one split as ``(atom_type, bond_type, y)``; a one-line
    ``ValueError`` naming the file when it does not hold their arrays (read as data only)."""
    try:
        with np.load(npz_path) as arrays:
            d = {name: arrays[name] for name in _EXACT_ARRAYS}
    except (ValueError, KeyError, OSError, EOFError, zipfile.BadZipFile) as error:
        raise ValueError(f"{npz_path} does not hold ZINC's subset graphs ({error}); replace it with the "
                         "file of the ZINC source files") from None
    out = []
    for g in range(len(d["y"])):
        n0, n1 = d["node_ptr"][g], d["node_ptr"][g + 1]
        e0, e1 = d["edge_ptr"][g], d["edge_ptr"][g + 1]
        bond_type = np.zeros((n1 - n0, n1 - n0), dtype=np.uint8)
        src, dst = d["edge_index"][:, e0:e1]
        bond_type[src, dst] = d["edge_attr"][e0:e1]
        out.append((d["x"][n0:n1].astype(np.uint8), bond_type, float(d["y"][g])))
    return out


class _PickledAsTensor:
    """Pickles as ``torch.from_numpy(array)``, much faster to unpickle than torch's own tensor pickling."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def __reduce__(self):
        return torch.from_numpy, (self.array,)


def build_zinc_raw(raw_dir: str | os.PathLike, source_dir: str | os.PathLike,
                   num_workers: int | None = None) -> None:
    """Write PyG's ZINC raw files into ``raw_dir`` from an offline source directory (needs RDKit),
    atomically: an incomplete ``raw_dir`` is replaced whole; PyG's processed files are left as
    they are."""
    source = resolve_zinc_source(source_dir)
    raw_dir = Path(raw_dir)
    vocabulary = json.loads((source / "atom_dict.json").read_text())["idx2word"]
    if tuple(vocabulary) != ZINC_ATOM_TOKENS:
        raise ValueError(f"{source / 'atom_dict.json'} lists atom tokens {vocabulary}, "
                         f"not the ZINC vocabulary {list(ZINC_ATOM_TOKENS)}")
    # read before the SMILES are featurized: a bad file is refused at once
    exact_graphs = {split: _exact_graphs(source / f"subset_{split}_graphs.npz") for split in ("val", "test")}
    with AtomicDirectory(raw_dir) as folder:
        tmp = folder.tmp
        for split in SPLITS:
            smiles = _read_lines(source / f"jtvae_{_SOURCE_SPLIT[split]}.smi.gz")
            labels = np.array(_read_lines(source / f"jtvae_{_SOURCE_SPLIT[split]}.y.gz"), dtype=np.float32)
            if len(smiles) != len(labels):
                raise ValueError(f"{source}: {len(smiles)} {split} SMILES but {len(labels)} labels")
            index_text = (source / f"subset_{split}.index").read_text().strip()
            subset_index = np.array([int(v) for v in index_text.split(",")], dtype=np.int64)
            exact = {}
            if split != "train":
                if len(exact_graphs[split]) != len(subset_index):
                    raise ValueError(f"subset_{split}_graphs.npz has {len(exact_graphs[split])} graphs, "
                                     f"subset_{split}.index {len(subset_index)}")
                exact = dict(zip(subset_index.tolist(), exact_graphs[split]))
            rebuild = [i for i in range(len(smiles)) if i not in exact]
            graphs = dict(zip(rebuild, zinc_graphs_from_smiles(
                [smiles[i] for i in rebuild], num_workers, desc=f"ZINC {split}: SMILES -> graphs")))
            mols = []
            for i in range(len(smiles)):
                atom_type, bond_type, y = exact[i] if i in exact else (*graphs[i], labels[i])
                mols.append({
                    "atom_type": _PickledAsTensor(atom_type),
                    "bond_type": _PickledAsTensor(bond_type),
                    "logP_SA_cycle_normalized": _PickledAsTensor(np.array([y], dtype=np.float32)),
                })
            with open(tmp / f"{split}.pickle", "wb") as f:
                pickle.dump(mols, f, protocol=pickle.HIGHEST_PROTOCOL)
            # PyG reads `f.read()[:-1]`: the trailing newline is required.
            (tmp / f"{split}.index").write_text(",".join(map(str, subset_index.tolist())) + "\n")
        if not _raw_complete(raw_dir):  # else another process finished first; an incomplete one is replaced whole
            folder.commit()


def _raw_complete(raw_dir: Path) -> bool:
    return all((raw_dir / name).is_file() for name in _RAW_FILES)


def load_zinc(root: str | os.PathLike = "data/ZINC", subset: bool = True, split: str = "train",
              source_dir: str | os.PathLike | None = None, num_workers: int | None = None,
              force_reload: bool = False):
    """``torch_geometric.datasets.ZINC(root, subset, split)``, its raw files built offline first when
    missing and a source directory is found (else PyG downloads them); a processed file that does
    not load is logged with its path and rebuilt."""
    from torch_geometric.datasets import ZINC

    if split not in SPLITS:
        raise ValueError(f"ZINC split must be one of {SPLITS}, got {split!r}")
    raw_dir = Path(root) / "raw"
    downloads = False  # PyG downloads the raw files
    if not _raw_complete(raw_dir):
        source = resolve_zinc_source(source_dir)
        if source is not None:
            log.info("building ZINC raw files in %s from %s", raw_dir, source)
            build_zinc_raw(raw_dir, source, num_workers)
        downloads = source is None
    processed = Path(root) / ("subset" if subset else "full") / "processed" / f"{split}.pt"
    with pyg_files_read_as_data():
        try:
            return ZINC(str(root), subset=subset, split=split, force_reload=force_reload)
        except (urllib.error.URLError, TimeoutError, ConnectionError) as error:
            if not downloads:
                raise
            raise ValueError(f"ZINC: no local copy of its source files (expected at {where_to_put(ZINC_DIR)}, "
                             f"or --data.init_args.source_dir) and the download of {ZINC.url} into {raw_dir} "
                             f"failed ({getattr(error, 'reason', None) or error})") from None
        except Exception as err:  # noqa: BLE001 - torch.load fails in many ways on a damaged file
            if force_reload or not processed.is_file():
                raise
            reason = str(err).splitlines()[0] if str(err) else ""
            log.warning("ZINC processed file %s is damaged, rebuilding it: %s: %s", processed,
                        type(err).__name__, reason)
        return ZINC(str(root), subset=subset, split=split, force_reload=True)


class RawZincUnpickler(pickle.Unpickler):
    """Reads ZINC's raw pickles (ours: tensors as ``torch.from_numpy``; PyG's download: pickled by
    torch) as data: any other callable in the file is refused with its name, so a planted raw file
    cannot run code."""

    #: (module, name) of the callables those files use; everything else is refused.
    ALLOWED = frozenset({
        ("torch", "from_numpy"), ("torch._C", "_VariableFunctionsClass"),
        ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor"),
        ("collections", "OrderedDict"), ("numpy", "ndarray"), ("numpy", "dtype"),
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
    })

    def __init__(self, file) -> None:
        super().__init__(file)
        self.path = getattr(file, "name", "a ZINC raw file")

    def refuse(self, call: str):
        raise pickle.UnpicklingError(f"{self.path}: not a ZINC raw file: it calls {call} when "
                                     "loaded; delete it to rebuild or download it")

    def attribute(self, owner, name: str):
        if owner is torch._C._VariableFunctionsClass and name == "from_numpy":
            return torch.from_numpy
        self.refuse(f"getattr(..., {name!r})")

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch.storage", "_load_from_bytes"):  # as data only
            return lambda data: torch.load(io.BytesIO(data), weights_only=True)
        if (module, name) == ("builtins", "getattr"):
            return self.attribute
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        self.refuse(f"{module}.{name}")


class _RawZincPickle:
    """Stands in for the ``pickle`` module inside PyG's ZINC (its ``process`` calls ``load``)."""

    @staticmethod
    def load(file):
        return RawZincUnpickler(file).load()


@contextlib.contextmanager
def pyg_files_read_as_data() -> Iterator[None]:
    """Within the block PyG's ZINC reads its files as data only: raw pickles through
    :class:`RawZincUnpickler`, processed files through
    :func:`~graphormer_urpe.utils.torch_files.read_checkpoint` (PyG's own reader retries with
    ``weights_only=False``, which would run a planted file's code; such a file is rebuilt instead)."""
    from torch_geometric.datasets import zinc as pyg_zinc
    from torch_geometric.io import fs

    from graphormer_urpe.utils.torch_files import read_checkpoint

    pyg_reader, pyg_pickle = fs.torch_load, pyg_zinc.pickle
    fs.torch_load = lambda path, map_location=None: read_checkpoint(
        path, map_location, what="processed file")
    pyg_zinc.pickle = _RawZincPickle
    try:
        yield
    finally:
        fs.torch_load, pyg_zinc.pickle = pyg_reader, pyg_pickle


class ZINCDataModule(GraphDataModule):
    """ZINC (subset: 10,000 / 1,000 / 1,000; full: 220,011 / 24,445 / 5,000) via PyG's ``ZINC``
    under ``<root>/ZINC``, built offline from ``source_dir`` or the local data copies when its raw
    files are missing. Prediction serves ``predict_split``. Other arguments:
    :class:`GraphDataModule`'s."""

    featurizer = "zinc"

    def __init__(self, root: str = "data", subset: bool = True, source_dir: str | None = None,
                 predict_split: str = "test", **kwargs) -> None:
        super().__init__(**kwargs)
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
        split = self.predict_split if split == "predict" else split
        with built_under(self.root.parent, "--data.init_args.root"):
            dataset = load_zinc(self.root, subset=self.subset, split=split, source_dir=self.source_dir,
                                num_workers=self.build_workers)
            return EncodedGraphDataset(flat_graphs_from_pyg(
                dataset, (dataset.processed_dir, split), self.encoding_params,
                self.atom_feature_dims, self.bond_feature_dims, self.encode_threads))

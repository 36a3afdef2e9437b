"""OGB-LSC PCQM4M (v1, KDD Cup 2021) and PCQM4Mv2 in their official layouts (``raw/data.csv.gz``,
``split_dict.pt``, ``RELEASE_v1.txt`` under :class:`~.lsc_layouts.LSCLayout`'s folder),
featurized with the ``"ogb"`` featurizer into exactly the graphs of OGB's own datasets.

OGB calls ``torch.load`` without ``weights_only``: :func:`allow_numpy_arrays` admits exactly
numpy's array reconstruction inside a ``with`` block, and :func:`ogb_dataset` refuses any
folder that would make OGB prompt with ``input()``."""
from __future__ import annotations

import contextlib
import gzip
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

from graphormer_urpe.data.datamodule import SMILESTableDataModule
from graphormer_urpe.data.lsc_layouts import PCQM4M, PCQM4MV2, RAW_TABLE, RELEASE_MARKER, SPLIT_FILE, LSCLayout
from graphormer_urpe.data.featurize import file_fingerprint
from graphormer_urpe.data.resident import ResidentLoader


@contextlib.contextmanager
def allow_numpy_arrays(pyg_data: bool = False) -> Iterator[None]:
    """Within the block, ``torch.load(weights_only=True)`` (the default) also accepts plain numpy
    arrays, as in OGB's ``split_dict.pt`` (and, with ``pyg_data``, PyG's ``Data`` containers, as in
    OGB's processed file); the allow-list is restored on exit."""
    core = getattr(np, "_core", None) or np.core
    wanted = [core.multiarray._reconstruct, np.ndarray, np.dtype,
              *(type(np.dtype(t)) for t in ("int64", "int32", "float32", "float64", "bool"))]
    if pyg_data:
        from torch_geometric.data.data import Data, DataEdgeAttr, DataTensorAttr
        from torch_geometric.data.storage import GlobalStorage

        wanted += [Data, DataEdgeAttr, DataTensorAttr, GlobalStorage]
    # only what is not allowed yet: leaving the block removes what it added (PyG allows Data itself)
    present = torch.serialization.get_safe_globals()
    allowed = [entry for entry in wanted if not any(entry is other for other in present)]
    with torch.serialization.safe_globals(allowed):
        yield


def _layout_hint(layout: LSCLayout) -> str:
    return (f"expected the OGB-LSC {layout.name} layout <root>/{layout.folder}/{RAW_TABLE.as_posix()} "
            f"+ <root>/{layout.folder}/{SPLIT_FILE}")


def require_layout(root: str | os.PathLike, layout: LSCLayout) -> Path:
    """``<root>/<folder>``, or a one-line ``ValueError`` naming what is missing."""
    folder = layout.path(root)
    if not Path(root).is_dir():
        raise ValueError(f"--root {root} is not a directory ({_layout_hint(layout)})")
    missing = [str(folder / name) for name in (RAW_TABLE, SPLIT_FILE) if not (folder / name).is_file()]
    if missing:
        raise ValueError(f"{layout.name} file(s) missing: {', '.join(missing)} ({_layout_hint(layout)})")
    return folder


def read_split_dict(root: str | os.PathLike, layout: LSCLayout) -> dict[str, np.ndarray]:
    """``split_dict.pt`` as int64 numpy arrays, loaded with ``weights_only=True`` and refused
    (:func:`check_split_dict`) for what needs no table, before the table is read and featurized."""
    path = layout.path(root) / SPLIT_FILE
    if not path.is_file():
        raise ValueError(f"{layout.name} split file {path} is missing ({_layout_hint(layout)})")
    try:
        with allow_numpy_arrays():
            raw = torch.load(path, weights_only=True)
    except Exception as exc:
        raise ValueError(f"{path} cannot be read ({type(exc).__name__}: {exc})") from exc
    if not isinstance(raw, Mapping):
        raise ValueError(f"{path} holds a {type(raw).__name__}, not a dict of splits")
    missing = [s for s in layout.splits if s not in raw]
    if missing:
        raise ValueError(f"{path} lacks splits {missing} (a {layout.name} split dict has {list(layout.splits)})")
    splits = {}
    for split in layout.splits:
        rows = np.asarray(raw[split])
        if rows.ndim != 1 or not (np.issubdtype(rows.dtype, np.integer) or rows.size == 0):
            raise ValueError(f"{path}: split {split!r} must be a 1-D array of integer row indices, "
                             f"got dtype {rows.dtype} and shape {rows.shape}")
        splits[split] = rows.astype(np.int64)
    check_split_dict(splits, None, None, path, layout)
    return splits


def check_split_dict(splits: Mapping[str, np.ndarray], num_rows: int | None, labels: np.ndarray | None,
                     where: str | os.PathLike, layout: LSCLayout) -> None:
    """Refuse (``ValueError`` naming the split and rows) a split dict whose rows are negative, past
    the table's ``num_rows``, repeated or shared by two splits, or whose train / valid rows lack a
    finite label; with ``num_rows`` and ``labels`` None, only the checks that need no table."""
    if num_rows is None:
        negative = {split: rows[rows < 0] for split, rows in splits.items()}
        for split, bad in negative.items():
            if len(bad):
                raise ValueError(f"{where}: split {split!r} has negative rows, e.g. {bad[:5].tolist()}")
        num_rows = max((int(rows.max()) + 1 for rows in splits.values() if len(rows)), default=0)
    owner = np.full(num_rows, -1, dtype=np.int64)
    for index, split in enumerate(layout.splits):
        rows = splits[split]
        bad = rows[(rows < 0) | (rows >= num_rows)]
        if len(bad):
            raise ValueError(f"{where}: split {split!r} has rows outside [0, {num_rows}) of the table, "
                             f"e.g. {bad[:5].tolist()}")
        repeated = np.flatnonzero(np.bincount(rows, minlength=num_rows) > 1)
        if len(repeated):
            raise ValueError(f"{where}: split {split!r} repeats rows, e.g. {repeated[:5].tolist()}")
        taken = owner[rows]
        if (taken >= 0).any():
            other = layout.splits[int(taken[taken >= 0][0])]
            shared = rows[taken >= 0]
            raise ValueError(f"{where}: splits {other!r} and {split!r} share {len(shared)} rows, "
                             f"e.g. {shared[:5].tolist()}")
        owner[rows] = index
        if labels is not None and split not in layout.test_splits:
            unlabelled = rows[~np.isfinite(labels[rows])]
            if len(unlabelled):
                raise ValueError(f"{where}: split {split!r} has {len(unlabelled)} rows without a finite "
                                 f"homolumogap, e.g. {unlabelled[:5].tolist()}")


def ogb_dataset(root: str | os.PathLike, layout: LSCLayout):
    """OGB's own PyG dataset at ``root`` and its split dict; a folder that would make OGB prompt
    (missing release marker or raw file) is a ``ValueError`` instead."""
    import ogb.lsc

    folder = layout.path(root)
    if not (folder / RELEASE_MARKER).is_file() or not (folder / RAW_TABLE).is_file():
        raise ValueError(f"{folder} is not a complete {layout.name} folder (needs {RELEASE_MARKER} and "
                         f"{RAW_TABLE.as_posix()}); OGB would ask on stdin to update or download it")
    with allow_numpy_arrays(pyg_data=True):
        dataset = getattr(ogb.lsc, layout.ogb_dataset)(root=str(root))
        return dataset, dataset.get_idx_split()


def read_table(root: str | os.PathLike, layout: LSCLayout) -> tuple[list[str], np.ndarray]:
    """SMILES ``[R]`` and HOMO-LUMO gaps ``[R]`` float32 (NaN in the test sets) of data.csv.gz."""
    import pandas as pd

    path = layout.path(root) / RAW_TABLE
    try:
        table = pd.read_csv(path, usecols=["smiles", "homolumogap"])
    except (ValueError, OSError, EOFError) as exc:  # a missing column, a damaged gzip stream
        raise ValueError(f"{path} cannot be read as an OGB-LSC table with columns idx, smiles, homolumogap "
                         f"({type(exc).__name__}: {exc})") from exc
    return table["smiles"].tolist(), table["homolumogap"].to_numpy(dtype=np.float32)


def write_root(root: str | os.PathLike, source_csv: str | os.PathLike, layout: LSCLayout,
               split_sizes: Mapping[str, int] | None = None, seed: int = 0) -> Path:
    """Write an OGB-format root of ``layout`` from real molecules (a test / submission fixture):
    ``source_csv``'s explicit-H CXSMILES (``smiles``) and gaps (``homo``) as plain SMILES. Without
    ``split_sizes`` every molecule once, 80 % train, 10 % valid, the rest shared by the test splits
    at random (``seed``); with them, consecutive row blocks of those sizes cycling through the
    molecules. Test rows get NaN gaps. Returns ``<root>/<folder>``."""
    import pandas as pd
    from rdkit import Chem, RDLogger

    RDLogger.DisableLog("rdApp.*")
    source = pd.read_csv(source_csv)
    smiles, gaps = [], []
    for line, (cxsmiles, gap) in enumerate(zip(source["smiles"], source["homo"]), start=2):
        mol = Chem.MolFromSmiles(cxsmiles)
        if mol is None:
            raise ValueError(f"{source_csv}: line {line}: RDKit cannot parse the SMILES")
        smiles.append(Chem.MolToSmiles(Chem.RemoveHs(mol)))
        gaps.append(gap)
    num_molecules = len(smiles)
    splits = layout.splits
    if split_sizes is None:
        order = np.random.default_rng(seed).permutation(num_molecules)
        test_share = 0.1 / len(layout.test_splits)
        fractions = [0.8, 0.1] + [test_share] * (len(layout.test_splits) - 1)
        bounds = np.round(np.cumsum(fractions) * num_molecules).astype(int)
        rows = dict(zip(splits, np.split(order, bounds)))
        molecule_of_row = np.arange(num_molecules)
    else:
        if set(split_sizes) != set(splits) or min(split_sizes.values()) < 0:
            raise ValueError(f"split_sizes needs non-negative sizes for exactly {splits}, got {dict(split_sizes)}")
        ends = np.cumsum([split_sizes[s] for s in splits])
        rows = dict(zip(splits, np.split(np.arange(ends[-1]), ends[:-1])))
        molecule_of_row = np.arange(ends[-1]) % num_molecules
    gap_of_row = np.asarray(gaps, dtype=np.float64)[molecule_of_row]
    for split in layout.test_splits:
        gap_of_row[rows[split]] = np.nan

    folder = layout.path(root)
    (folder / "raw").mkdir(parents=True, exist_ok=True)
    table = pd.DataFrame({"idx": np.arange(len(molecule_of_row)),
                          "smiles": np.asarray(smiles, dtype=object)[molecule_of_row],
                          "homolumogap": gap_of_row})
    with gzip.open(folder / RAW_TABLE, "wt", compresslevel=1) as f:
        table.to_csv(f, index=False)
    torch.save({s: np.asarray(rows[s], dtype=np.int64) for s in splits}, folder / SPLIT_FILE)
    (folder / RELEASE_MARKER).write_text(f"{layout.name} fixture in the OGB-LSC layout (graphormer_urpe)\n")
    return folder


class OGBLSCDataModule(SMILESTableDataModule):
    """An OGB-LSC PCQM4M version (:attr:`layout`) from its official layout under ``root``: HOMO-LUMO
    gap regression on ``ogb`` features. fit -> train / valid, test -> ``test_split`` (default valid:
    the test sets have no public labels), predict -> ``predict_split`` (default: the first test set,
    in the order of OGB's submission file). ``download=True`` fetches OGB's archive when the layout
    is missing. The split dict is checked against the table before anything is served. Other
    arguments: :class:`GraphDataModule`'s."""

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
        folder = self.layout.path(self.root)
        table = folder / RAW_TABLE
        if not table.is_file():
            if not self.download:
                raise ValueError(f"{self.layout.name} table {table} is missing (expected the OGB-LSC "
                                 "layout; download=True fetches it)")
            from ogb.utils.url import download_url, extract_zip

            archive = download_url(self.layout.url, str(self.root))  # OGB's archive, unpacked without a prompt
            extract_zip(archive, str(self.root))
            os.unlink(archive)
        require_layout(self.root, self.layout)  # the split dict too, before featurizing
        self._splits = read_split_dict(self.root, self.layout)
        return (folder / "processed_graphormer_urpe", file_fingerprint(table),
                lambda: read_table(self.root, self.layout))

    def split_rows(self, graph_of_row: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
        folder = self.layout.path(self.root)
        rejected = np.flatnonzero(graph_of_row < 0)
        if len(rejected):
            raise ValueError(f"{folder / RAW_TABLE}: RDKit rejects the SMILES of rows "
                             f"{rejected[:10].tolist()}")
        check_split_dict(self._splits, len(graph_of_row), y.reshape(len(graph_of_row), -1)[:, 0],
                         folder / SPLIT_FILE, self.layout)
        return self._splits

    def ogb_split_loader(self, name: str) -> DataLoader | ResidentLoader:
        """Evaluation loader (``eval_batch_size``, split order) over OGB split ``name``."""
        return self._loader(self.table_split(name), self.eval_batch_size, None)


class PCQM4MDataModule(OGBLSCDataModule):
    """PCQM4M (OGB-LSC 2021, v1) under ``<root>/pcqm4m_kddcup2021/``; prediction serves ``test``."""

    layout = PCQM4M


class PCQM4Mv2DataModule(OGBLSCDataModule):
    """PCQM4Mv2 under ``<root>/pcqm4m-v2/``; prediction serves ``test-dev``."""

    layout = PCQM4MV2

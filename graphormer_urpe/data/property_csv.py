"""Molecule property tables: a CSV with a SMILES column and one or more target columns
(empty = unknown), read, checked and split (random, scaffold or a split file)."""
from __future__ import annotations

import io
import logging
import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from graphormer_urpe.data.datamodule import SMILESTableDataModule
from graphormer_urpe.data.dataset import check_seed
from graphormer_urpe.data.descriptors import cached_descriptors, clip_statistics, descriptor_names
from graphormer_urpe.data.featurize import REJECTED_ROW, TOO_LARGE_ROW, featurizer_spec, file_fingerprint
from graphormer_urpe.data.local_data import built_under, data_file
from graphormer_urpe.utils.files import unreadable_as_a_file
from graphormer_urpe.data.task import TASKS

log = logging.getLogger(__name__)

SPLIT_NAMES = ("train", "val", "test")


def read_csv_bytes(path: str | os.PathLike) -> bytes:
    """The bytes of the CSV file ``path``, read once for every parse of it (:func:`_read_csv`) and its
    fingerprint; ``ValueError`` naming the file when it is not a regular file."""
    problem = unreadable_as_a_file(path)
    if problem:
        raise ValueError(f"CSV file {path} {problem}")
    return Path(path).read_bytes()


def resolve_columns(path: Path, data: bytes, smiles_column: str = "smiles",
                    target_columns: Sequence[str] | None = None) -> list[str]:
    """The target columns (None: every column but the SMILES) of CSV ``data`` (the bytes of
    ``path``), checked against its header; ``ValueError`` naming the file for a missing column, a
    repeated name or no data row."""
    head = _head(path, data, smiles_column)
    columns = list(head.columns)
    targets = [c for c in columns if c != smiles_column] if target_columns is None else list(target_columns)
    if not targets:
        raise ValueError(f"{path}: no target columns")
    missing = [c for c in targets if c not in columns]
    if missing:
        raise ValueError(f"{path} has no target column(s) {missing} (columns: {columns})")
    # pandas renames a repeated column name ("y", "y.1"), so a run would silently read the first
    names = list(_read_csv(path, data, header=None, nrows=1, dtype=str, keep_default_na=False).iloc[0])
    repeated = sorted({name for name in names if names.count(name) > 1
                       and (target_columns is None or name in (smiles_column, *targets))})
    if repeated:
        positions = [[i + 1 for i, name in enumerate(names) if name == r] for r in repeated]
        raise ValueError(f"{path} names more than one column {', '.join(map(repr, repeated))} "
                         f"(columns {'; '.join(map(str, positions))} of the header): rename them so "
                         "that each name is one column")
    if head.empty:
        raise ValueError(f"{path} has a header but no data rows")
    return targets


def read_smiles_column(path: str | os.PathLike, smiles_column: str = "smiles") -> list[str]:
    """The stripped SMILES of ``smiles_column`` of a CSV that may have no other column."""
    path = Path(path)
    data = read_csv_bytes(path)
    _head(path, data, smiles_column)
    table = _read_csv(path, data, usecols=[smiles_column], dtype=str, keep_default_na=False)
    return [s.strip() for s in table[smiles_column]]


def _head(path: Path, data: bytes, smiles_column: str):
    """The header and first row of CSV ``data``; ``ValueError`` naming the file when it has no column
    ``smiles_column``."""
    head = _read_csv(path, data, nrows=1)
    if smiles_column not in head.columns:
        raise ValueError(f"{path} has no SMILES column {smiles_column!r} (columns: {list(head.columns)})")
    return head


def _read_csv(path: Path, data: bytes, **kwargs):
    """``pandas.read_csv`` of ``data``, the bytes of ``path`` (compressed as its name says), with a
    one-line ``ValueError`` naming the file when it is empty or not UTF-8."""
    import pandas as pd
    from pandas.io.common import infer_compression

    try:
        return pd.read_csv(io.BytesIO(data), compression=infer_compression(str(path), "infer"), **kwargs)
    except pd.errors.EmptyDataError:
        raise ValueError(f"CSV file {path} is empty (no header line)") from None
    except UnicodeDecodeError:
        for number, line in enumerate(data.split(b"\n"), start=1):  # where the first byte that is not UTF-8 is
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as err:
                where = f"line {number}: {line[max(err.start - 10, 0):err.end + 10]!r}"
                break
        else:
            where = "a byte sequence split across lines"
        raise ValueError(f"{path} is not UTF-8 text ({where}); save it as UTF-8") from None


def read_property_csv(path: Path, data: bytes, smiles_column: str = "smiles",
                      target_columns: Sequence[str] | None = None) -> tuple[list[str], np.ndarray, list[str]]:
    """``(smiles [R], y [R, T] float32, target_columns)`` of CSV ``data`` (the bytes of ``path``);
    ``ValueError`` naming the file for a missing or non-numeric column."""
    import pandas as pd

    targets = resolve_columns(path, data, smiles_column, target_columns)
    table = _read_csv(path, data)
    try:
        values = table[targets].apply(pd.to_numeric, errors="raise").to_numpy(dtype=np.float64)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{path}: target columns {targets} must be numeric ({err})") from None
    with np.errstate(over="ignore"):  # beyond float32's range -> inf, rejected by the caller
        y = values.astype(np.float32)
    smiles = ["" if not isinstance(s, str) else s.strip() for s in table[smiles_column]]
    return smiles, y.reshape(len(smiles), len(targets)), targets


def nonfinite_target_rows(y: np.ndarray) -> np.ndarray:
    """Rows of ``y [R, T]`` with an infinite target (NaN is an unknown label, not an error)."""
    return np.flatnonzero(np.isinf(y).any(axis=1))


def check_targets(path: str | os.PathLike, y: np.ndarray, target_columns: Sequence[str],
                  task: str) -> None:
    """``ValueError`` naming the file and column for a target column without a known value among the
    usable rows ``y``, or labels that do not fit ``task``."""
    empty = [c for c, column in zip(target_columns, y.T) if not np.isfinite(column).any()]
    if empty:
        raise ValueError(f"{path}: target column(s) {empty} have no usable value")
    known = y[np.isfinite(y)]
    if task == "classification" and not np.isin(known, (0.0, 1.0)).all():
        raise ValueError(f"{path}: classification targets must be 0, 1 or empty")
    if task == "classification":
        single = [(c, np.unique(column[np.isfinite(column)])) for c, column in zip(target_columns, y.T)]
        single = [(c, classes) for c, classes in single if len(classes) == 1]
        if single:
            column, classes = single[0]
            raise ValueError(f"{path}: classification column {column!r} has only class {classes[0]:g}: "
                             "a classifier needs both 0 and 1 (AUROC is undefined with one class)"
                             + (f"; so do {[c for c, _ in single[1:]]}" if len(single) > 1 else ""))
    if task == "multiclass":
        if y.shape[1] != 1:
            raise ValueError(f"{path}: multiclass needs one target column of class ids, got "
                             f"{list(target_columns)}")
        classes = np.unique(known)
        column = target_columns[0]
        bad = classes[(classes != np.round(classes)) | (classes < 0)]
        if len(bad):
            raise ValueError(f"{path}: multiclass column {column!r} must hold class ids 0, 1, 2, ... "
                             f"or be empty, got {_few(bad)}")
        missing = np.setdiff1d(np.arange(int(classes.max()) + 1), classes)
        if len(missing):
            raise ValueError(f"{path}: multiclass column {column!r} must hold class ids 0..K-1 with "
                             f"every class present (the model has one output per id up to the "
                             f"largest); it has {_few(classes)} but not {_few(missing)}: renumber "
                             f"the classes 0..{len(classes) - 1}")


def _few(values: np.ndarray, shown: int = 10) -> str:
    text = ", ".join(f"{v:g}" for v in values[:shown])
    return f"[{text}{', ...' if len(values) > shown else ''}]"


def warn_rejected_rows(path: str | os.PathLike, rejected_rows: np.ndarray, total: int,
                       reason: str = "whose SMILES RDKit rejects", shown: int = 10) -> None:
    """One warning for all rejected rows (file line numbers: row + 2)."""
    if len(rejected_rows) == 0:
        return
    lines = ", ".join(str(int(r) + 2) for r in rejected_rows[:shown])
    more = ", ..." if len(rejected_rows) > shown else ""
    warnings.warn(f"{path}: skipped {len(rejected_rows)} of {total} rows {reason} "
                  f"(lines {lines}{more})", stacklevel=2)


def random_split(num_rows: int, fractions: Sequence[float], seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded random ``train/val/test`` row indices with the given fractions."""
    order = np.random.default_rng(seed).permutation(num_rows)
    return dict(zip(SPLIT_NAMES, np.split(order, np.round(np.cumsum(fractions[:2]) * num_rows).astype(int))))


def murcko_scaffold(smiles: str) -> str:
    """Bemis-Murcko scaffold SMILES (no chirality); ``""`` for acyclic molecules."""
    from rdkit import Chem
    from rdkit.Chem.Scaffolds import MurckoScaffold

    return MurckoScaffold.MurckoScaffoldSmiles(mol=Chem.MolFromSmiles(smiles), includeChirality=False)


def scaffold_split(smiles: Sequence[str], fractions: Sequence[float]) -> dict[str, np.ndarray]:
    """Bemis-Murcko scaffold groups, largest first (ties: first occurrence), fill train up to its
    share, then val, then test (as DeepChem and chemprop split)."""
    groups: dict[str, list[int]] = {}
    for row, s in enumerate(smiles):
        groups.setdefault(murcko_scaffold(s), []).append(row)
    ordered = sorted(groups.values(), key=lambda rows: (-len(rows), rows[0]))
    n = len(smiles)
    train_cut, val_cut = fractions[0] * n, (fractions[0] + fractions[1]) * n
    parts: dict[str, list[int]] = {name: [] for name in SPLIT_NAMES}
    for rows in ordered:
        if len(parts["train"]) + len(rows) <= train_cut:
            parts["train"] += rows
        elif len(parts["train"]) + len(parts["val"]) + len(rows) <= val_cut:
            parts["val"] += rows
        else:
            parts["test"] += rows
    return {name: np.array(sorted(rows), dtype=np.int64) for name, rows in parts.items()}


def read_split_file(path: str | os.PathLike, num_rows: int) -> dict[str, np.ndarray]:
    """``{train, val, test: rows}`` of a JSON split file (0-based data rows; chemprop's
    ``--splits-file`` form, a list of one such object, too); ``ValueError`` naming the file for a
    missing key, a row that is not an integer in ``[0, num_rows)`` or a row in two splits."""
    import json

    path = Path(path)
    problem = unreadable_as_a_file(path)
    if problem:
        raise ValueError(f"split file {path} {problem}")
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"split file {path} is not JSON ({err})") from None
    if isinstance(content, list) and len(content) == 1:
        content = content[0]
    if not isinstance(content, dict) or set(content) != set(SPLIT_NAMES):
        raise ValueError(f"split file {path} must hold {{\"train\": [rows], \"val\": [rows], "
                         "\"test\": [rows]}} (or a list of one such object)")
    parts = {}
    for name in SPLIT_NAMES:
        rows = content[name]
        if not isinstance(rows, list) or not all(isinstance(r, int) and not isinstance(r, bool) for r in rows):
            raise ValueError(f"split file {path}: {name!r} must be a list of integer rows")
        bad = [r for r in rows if not 0 <= r < num_rows]
        if bad:
            raise ValueError(f"split file {path}: {name!r} has rows {_few(np.array(bad))} outside the "
                             f"CSV's {num_rows} data rows (0-based, header not counted)")
        parts[name] = np.array(rows, dtype=np.int64)
    for i, a in enumerate(SPLIT_NAMES):
        for b in SPLIT_NAMES[i + 1:]:
            both = np.intersect1d(parts[a], parts[b])
            if len(both):
                raise ValueError(f"split file {path}: rows {_few(both)} are in both {a!r} and {b!r}")
    return parts


def check_fractions(fractions: Sequence[float]) -> tuple[float, float, float]:
    fractions = tuple(float(f) for f in fractions)
    if len(fractions) != 3 or min(fractions) < 0 or abs(sum(fractions) - 1) > 1e-6:
        raise ValueError(f"split_fractions must be three non-negative numbers summing to 1, got {fractions}")
    return fractions


class CSVDataModule(SMILESTableDataModule):
    """A molecule property CSV ``path`` (``data:<file>``: a file of the local data copies) with
    ``smiles_column`` and ``target_columns`` (default: every other column; empty = unknown).

    ``task``: ``regression``, ``classification`` (binary or multi-label 0/1 columns) or
    ``multiclass`` (one column of class ids 0..K-1). ``split``: random (from ``split_seed``, not the
    training ``seed``, so runs with other seeds share one test set) or scaffold, with
    ``split_fractions``; or the rows of a JSON ``split_file`` (chemprop's ``--splits-file``). Rows
    whose SMILES RDKit (or the ``featurizer``: ``ogb``, or ``zinc`` with its 28 atom tokens)
    rejects, rows with an infinite target and rows of more than ``max_nodes`` atoms (known from the
    SMILES, never featurized) are skipped in every split with one warning per kind. Featurized and
    encoded once into ``cache_root``, keyed by the file's content. Prediction serves the test split.
    ``molecule_descriptors``: batches also carry the molecules' raw RDKit descriptors, which the
    model standardizes with the TRAINING split's statistics (:meth:`descriptor_statistics`) and reads
    beside its readout. Other arguments: :class:`GraphDataModule`'s."""

    def __init__(self, path: str, smiles_column: str = "smiles", target_columns: list[str] | None = None,
                 task: str = "regression", split: str = "random",
                 split_fractions: tuple[float, float, float] = (0.8, 0.1, 0.1), cache_root: str = "data/csv",
                 batch_size: int = 32, featurizer: str = "ogb", split_file: str | None = None,
                 split_seed: int = 0, molecule_descriptors: bool = False, **kwargs) -> None:
        super().__init__(batch_size=batch_size, **kwargs)
        self.molecule_descriptors = bool(molecule_descriptors)
        if self.molecule_descriptors and self.device_resident:
            raise ValueError("molecule_descriptors needs the DataLoader: drop --data.init_args.device_resident "
                             "(device-resident batches carry no descriptors)")
        self._row_descriptors: np.ndarray | None = None
        self._table: tuple[list[str], np.ndarray, list[str]] | None = None  # the file's rows, parsed once
        if task not in TASKS:
            raise ValueError(f"task must be one of {list(TASKS)}, got {task!r}")
        if split not in ("random", "scaffold"):
            raise ValueError(f"split must be 'random' or 'scaffold', got {split!r}")
        self.featurizer = featurizer_spec(featurizer).name
        self.path = data_file(path)  # a file, or data:<file> of the local data copies
        self.smiles_column = smiles_column
        self.split = split
        self.split_file = None if split_file is None else Path(split_file)
        if self.split_file is not None:
            problem = unreadable_as_a_file(self.split_file)
            if problem:
                raise ValueError(f"split file {self.split_file} {problem}")
        self.split_fractions = check_fractions(split_fractions)
        self.split_seed = check_seed("data.init_args.split_seed", split_seed)
        self.cache_root = Path(cache_root)
        self.task = task
        self.table_max_atoms = self.max_nodes
        # the file is read once: its bytes serve every parse (until the table is parsed) and its fingerprint
        self._data: bytes | None = read_csv_bytes(self.path)
        self._file = file_fingerprint(self.path, self._data)
        self.target_columns = resolve_columns(self.path, self._data, smiles_column, target_columns)
        self._num_classes = None
        if task != "regression":  # labels, read before the data is built: the model's width
            _, y, _ = self._read()  # (multiclass), and a refusal before any work
            usable = np.delete(y, nonfinite_target_rows(y), axis=0)
            check_targets(self.path, usable, self.target_columns, task)
            if task == "multiclass":
                self._num_classes = max(int(np.nanmax(usable)) + 1, 2)

    @property
    def num_targets(self) -> int:
        return self._num_classes or len(self.target_columns)

    @property
    def num_descriptors(self) -> int:
        return len(descriptor_names()) if self.molecule_descriptors else 0

    def row_descriptors(self) -> np.ndarray:
        """``[R, D]`` raw RDKit descriptors of every row (NaN where one fails), cached per distinct SMILES."""
        if self._row_descriptors is None:
            work_dir, source, _ = self.table_source()
            smiles = self._read()[0]
            distinct, of_row = np.unique(np.array(smiles, dtype=object), return_inverse=True)
            raw = cached_descriptors(work_dir / "descriptors", {**self._file,
                                     "smiles_column": self.smiles_column}, list(distinct), self.build_workers)
            self._row_descriptors = raw[of_row.reshape(-1)]
        return self._row_descriptors

    def descriptor_statistics(self) -> tuple[np.ndarray, ...]:
        """:func:`~.descriptors.clip_statistics` of the training split's raw descriptors."""
        return clip_statistics(self.row_descriptors()[self.store()[3]["train"]])

    def table_split(self, name: str):
        dataset = super().table_split(name)
        if self.molecule_descriptors:
            dataset.descriptors = self.row_descriptors()[self.store()[3][name]]
        return dataset

    def _read(self) -> tuple[list[str], np.ndarray, list[str]]:
        if self._table is None:
            self._table = read_property_csv(self.path, self._data, self.smiles_column, self.target_columns)
            self._data = None
        return self._table

    def table_source(self) -> tuple[Path, dict, Callable[[], tuple[Sequence[str], np.ndarray]]]:
        source = {**self._file, "smiles_column": self.smiles_column,
                  "target_columns": self.target_columns}
        # one work directory per featurizer (ogb's without a suffix)
        suffix = "" if self.featurizer == "ogb" else f"-{self.featurizer}"
        return (self.cache_root / f"{self.path.stem}-{source['blake2b'][:12]}{suffix}", source,
                lambda: self._read()[:2])

    def store(self):
        with built_under(self.cache_root, "--data.init_args.cache_root"):
            return super().store()

    def split_rows(self, graph_of_row: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
        bad_targets = nonfinite_target_rows(y)
        rejects = "RDKit" if self.featurizer == "ogb" else f"RDKit or the {self.featurizer!r} featurizer"
        for rows, why in ((np.flatnonzero(graph_of_row == REJECTED_ROW), f"whose SMILES {rejects} rejects"),
                          (np.flatnonzero(graph_of_row == TOO_LARGE_ROW),
                           f"with more than max_nodes={self.max_nodes} atoms"),
                          (bad_targets, "with an infinite or out-of-range target")):
            warn_rejected_rows(self.path, rows, len(y), why)
        usable = graph_of_row >= 0
        usable[bad_targets] = False
        if self.molecule_descriptors:
            none = np.flatnonzero(usable & np.isnan(self.row_descriptors()).all(axis=1))
            warn_rejected_rows(self.path, none, len(y), "whose molecule gets no RDKit descriptor")
            usable[none] = False
        valid = np.flatnonzero(usable)
        if len(valid) == 0:
            reasons = [f"{count} {why}" for count, why in (
                (np.sum(graph_of_row == REJECTED_ROW), "rejected by RDKit or the featurizer"),
                (np.sum(graph_of_row == TOO_LARGE_ROW), f"with more than max_nodes={self.max_nodes} atoms"),
                (len(bad_targets), "with an infinite target")) if count]
            raise ValueError(f"{self.path}: no row is usable: of its {len(y)} rows, {', '.join(reasons)}")
        check_targets(self.path, y[valid], self.target_columns, self.task)
        if self.split_file is not None:
            parts = read_split_file(self.split_file, len(y))
            for name, rows in parts.items():
                skipped = np.setdiff1d(rows, valid)
                if len(skipped):
                    log.warning("%s: split %r skips %d of its rows whose molecule or target cannot be "
                                "used (rows %s; see above)", self.split_file, name, len(skipped),
                                skipped[:10].tolist())
            parts = {name: rows[np.isin(rows, valid)] for name, rows in parts.items()}
        elif self.split == "random":
            parts = {name: valid[rows] for name, rows in
                     random_split(len(valid), self.split_fractions, self.split_seed).items()}
        else:
            smiles = self._read()[0]
            parts = {name: valid[rows] for name, rows in
                     scaffold_split([smiles[r] for r in valid], self.split_fractions).items()}
        empty = [name for name in SPLIT_NAMES if len(parts[name]) == 0]
        if empty:
            how = (f"split file {self.split_file}" if self.split_file is not None
                   else f"split {self.split!r}, split_fractions {self.split_fractions}")
            raise ValueError(f"{self.path}: the {' and '.join(map(repr, empty))} split(s) would have no "
                             f"rows ({len(valid)} usable of {len(y)} rows, {how}): every split needs at "
                             "least one; give more rows or other fractions")
        return parts

    def predict_smiles(self) -> list[str]:
        """The SMILES of the predict split's items, in order."""
        smiles, _, _ = self._read()
        return [smiles[row] for row in self.store()[3]["test"]]

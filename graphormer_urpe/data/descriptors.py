"""RDKit 2D descriptors as label-free pretraining targets, and the DataModule that serves them.

Any file of SMILES becomes a multi-task regression set: each molecule's :data:`DESCRIPTOR_NAMES`
(RDKit's 2D descriptors: counts, surface areas, charges, topological indices, fragment counts),
each clipped to its 0.1-99.9 % quantiles over the file and standardised. A backbone that learns
to predict them from the graph alone has learnt general chemistry (size, polarity, lipophilicity,
aromaticity, functional groups) that small property sets cannot teach, as chemprop's CheMeleon
does with Mordred descriptors. The descriptors are computed once per file, on worker processes,
and cached beside the featurized graphs (:mod:`.array_store`).
"""
from __future__ import annotations

import gzip
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from graphormer_urpe.data import property_csv
from graphormer_urpe.data.datamodule import SMILESTableDataModule
from graphormer_urpe.data.dataset import check_seed
from graphormer_urpe.data.featurize import featurizer_spec, file_fingerprint, parallel_map
from graphormer_urpe.data.local_data import data_file
from graphormer_urpe.utils.files import unreadable_as_a_file

#: Left out: ``Ipc`` (spans 50 orders of magnitude), ``qed`` (a composite of the others and the
#: slowest), ``SPS`` and the eight ``BCUT2D_*`` (slow; charges and masses are covered by others).
_LEFT_OUT = ("Ipc", "qed", "SPS")


def descriptor_functions() -> list[tuple[str, Callable]]:
    """``(name, function of an RDKit Mol)`` of every descriptor used, in a fixed order."""
    from rdkit.Chem import Descriptors

    return [(name, f) for name, f in Descriptors._descList
            if name not in _LEFT_OUT and not name.startswith("BCUT2D")]


def descriptor_names() -> list[str]:
    return [name for name, _ in descriptor_functions()]


def _descriptor_chunk(smiles: Sequence[str]) -> np.ndarray:
    """``[len(smiles), D]`` float32 raw descriptors; a row of NaN where RDKit rejects the SMILES,
    NaN where one descriptor fails or is not finite."""
    from rdkit import Chem, RDLogger

    RDLogger.DisableLog("rdApp.*")
    functions = descriptor_functions()
    out = np.full((len(smiles), len(functions)), np.nan, dtype=np.float64)
    for row, s in enumerate(smiles):
        mol = Chem.MolFromSmiles(s) if s else None
        if mol is None:
            continue
        for column, (_, function) in enumerate(functions):
            try:
                out[row, column] = function(mol)
            except Exception:  # RDKit raises assorted errors on odd molecules: leave that one NaN
                pass
    with np.errstate(over="ignore", invalid="ignore"):
        out = out.astype(np.float32)
    out[~np.isfinite(out)] = np.nan
    return out


def clip_statistics(raw: np.ndarray) -> tuple[np.ndarray, ...]:
    """``(low, high, mean, std)`` per column of ``raw [R, D]``: its 0.1-99.9 % quantiles and the
    mean and std once clipped to them, ignoring NaN (a constant column's std is 1)."""
    low, high = np.nanpercentile(raw, [0.1, 99.9], axis=0)
    clipped = np.clip(raw, low, high)
    mean, std = np.nanmean(clipped, axis=0), np.nanstd(clipped, axis=0)
    return low, high, mean, np.where(std > 1e-6, std, 1.0)


def standardize(raw: np.ndarray, statistics: tuple[np.ndarray, ...] | None = None) -> np.ndarray:
    """``raw [R, D]`` clipped per column to its 0.1-99.9 % quantiles (ignoring NaN), minus the
    clipped mean, over the clipped std (a constant column becomes 0); the quantiles, mean and std
    are ``statistics`` (:func:`clip_statistics` of other molecules, e.g. a training split) where
    given, else ``raw``'s own."""
    low, high, mean, std = clip_statistics(raw) if statistics is None else statistics
    return ((np.clip(raw, low, high) - mean) / std).astype(np.float32)


def raw_descriptors(smiles: Sequence[str], num_workers: int | None = None, chunk_size: int = 2000
                    ) -> Iterator[np.ndarray]:
    """The raw descriptors of ``smiles`` in blocks of ``chunk_size`` rows (float32 ``[rows, D]``,
    NaN where RDKit fails), in order, on worker processes with a progress bar."""
    starts = range(0, len(smiles), chunk_size)
    chunks = (list(smiles[s:s + chunk_size]) for s in starts)
    sizes = [min(chunk_size, len(smiles) - s) for s in starts]
    return parallel_map(_descriptor_chunk, chunks, num_workers, "rdkit descriptors", sizes)


def read_smiles_file(path: str | os.PathLike, smiles_column: str = "smiles") -> list[str]:
    """The SMILES of a file: a CSV (``.csv``, ``.csv.gz``) by ``smiles_column``, anything else
    one SMILES per line (its first field; gzip when the name ends in ``.gz``)."""
    path = Path(path)
    if ".csv" in path.suffixes:
        return property_csv.read_smiles_column(path, smiles_column)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [line.split()[0] if line.strip() else "" for line in f]


def cached_descriptors(directory: Path, source: dict, smiles: Sequence[str], num_workers: int | None,
                       chunk_size: int = 2000) -> np.ndarray:
    """Raw descriptors ``[R, D]`` of ``smiles``, computed once (workers, tqdm) into the cache
    entry ``directory`` keyed by ``source`` and the RDKit version."""
    import rdkit

    from graphormer_urpe.data.array_store import cached_entry

    names = descriptor_names()
    fingerprint = {"kind": "rdkit descriptors", "source": source, "rdkit": rdkit.__version__, "names": names}

    def build(writer) -> None:
        out = writer.array("raw", np.float32, row_shape=(len(names),))
        for block in raw_descriptors(smiles, num_workers, chunk_size):
            out.append(block)

    return np.asarray(cached_entry(directory, fingerprint, build, expect=("raw",))["raw"])


class DescriptorDataModule(SMILESTableDataModule):
    """Pretraining on any molecules without labels: the targets are each SMILES' standardized
    RDKit descriptors (module docstring; ``num_targets`` = ``len(descriptor_names())``).

    Args:
        path: the molecules: one SMILES per line (``.smi``, ``.txt``, optionally ``.gz``) or a
            CSV with ``smiles_column``; ``data:<file>`` names a file of the local data copies
            (:func:`~.local_data.data_file`).
        split_fractions: random train / val / test shares, drawn from ``split_seed`` (not from
            the training ``seed``: runs with other seeds share one split).
        cache_root: where the descriptors, graphs and encodings are cached (keyed by content).
        featurizer: ``ogb`` (default: fits any organic CSV later) or ``zinc``.
        **kwargs: :class:`~.datamodule.GraphDataModule`'s.
    """

    def __init__(self, path: str, smiles_column: str = "smiles",
                 split_fractions: tuple[float, float, float] = (0.96, 0.02, 0.02),
                 cache_root: str = "data/descriptors", batch_size: int = 128, featurizer: str = "ogb",
                 split_seed: int = 0, **kwargs) -> None:
        super().__init__(batch_size=batch_size, **kwargs)
        self.path = data_file(path)
        problem = unreadable_as_a_file(self.path)
        if problem:
            raise ValueError(f"SMILES file {self.path} {problem}")
        self.smiles_column = smiles_column
        self.split_fractions = property_csv.check_fractions(split_fractions)
        self.split_seed = check_seed("data.init_args.split_seed", split_seed)
        self.cache_root = Path(cache_root)
        self.featurizer = featurizer_spec(featurizer).name
        self.task = "regression"
        self.target_columns = descriptor_names()
        self.table_max_atoms = self.max_nodes

    @property
    def num_targets(self) -> int:
        return len(self.target_columns)

    def table_source(self) -> tuple[Path, dict, Callable[[], tuple[Sequence[str], np.ndarray]]]:
        file = file_fingerprint(self.path)
        source = {**file, "smiles_column": self.smiles_column, "targets": "standardized rdkit descriptors",
                  "names": self.target_columns}
        work_dir = self.cache_root / f"{self.path.name.split('.')[0]}-{file['blake2b'][:12]}"
        suffix = "" if self.featurizer == "ogb" else f"-{self.featurizer}"

        def read() -> tuple[list[str], np.ndarray]:
            smiles = read_smiles_file(self.path, self.smiles_column)
            if not any(smiles):
                raise ValueError(f"SMILES file {self.path} holds no SMILES")
            raw = cached_descriptors(work_dir / "descriptors", file, smiles, self.build_workers)
            return smiles, standardize(raw)

        return work_dir.with_name(work_dir.name + suffix), source, read

    def split_rows(self, graph_of_row: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
        valid = np.flatnonzero((graph_of_row >= 0) & np.isfinite(y).any(axis=1))
        property_csv.warn_rejected_rows(self.path, np.setdiff1d(np.arange(len(y)), valid), len(y),
                                        "that RDKit or the featurizer rejects")
        if len(valid) == 0:
            raise ValueError(f"{self.path}: no SMILES that RDKit accepts")
        parts = property_csv.random_split(len(valid), self.split_fractions, self.split_seed)
        return {name: valid[rows] for name, rows in parts.items()}

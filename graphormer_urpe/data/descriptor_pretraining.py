"""Pretraining on molecules without labels: each SMILES' standardized RDKit descriptors
(:mod:`.descriptors`) as a multi-task regression set, and the DataModule that serves them."""
from __future__ import annotations

import gzip
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from graphormer_urpe.data import property_csv
from graphormer_urpe.data.datamodule import SMILESTableDataModule
from graphormer_urpe.data.dataset import check_seed
from graphormer_urpe.data.descriptors import cached_descriptors, descriptor_names, standardize
from graphormer_urpe.data.featurize import featurizer_spec, file_fingerprint
from graphormer_urpe.data.local_data import data_file
from graphormer_urpe.utils.files import unreadable_as_a_file


def read_smiles_file(path: str | os.PathLike, smiles_column: str = "smiles") -> list[str]:
    """The SMILES of a file: a CSV (``.csv``, ``.csv.gz``) by ``smiles_column``, anything else
    one SMILES per line (its first field; gzip when the name ends in ``.gz``)."""
    path = Path(path)
    if ".csv" in path.suffixes:
        return property_csv.read_smiles_column(path, smiles_column)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [line.split()[0] if line.strip() else "" for line in f]


class DescriptorDataModule(SMILESTableDataModule):
    """Pretraining on molecules without labels: the targets are each SMILES' standardized RDKit
    descriptors (``num_targets`` = ``len(descriptor_names())``).

    Args:
        path: one SMILES per line (``.smi``, ``.txt``, optionally ``.gz``) or a CSV with
            ``smiles_column``; ``data:<file>`` names a file of the local data copies.
        split_fractions: random train / val / test shares, drawn from ``split_seed`` (not the
            training ``seed``: runs with other seeds share one split).
        cache_root: where the descriptors, graphs and encodings are cached (keyed by content).
        featurizer: ``ogb`` (default: fits any organic CSV later) or ``zinc``.
        **kwargs: :class:`~.datamodule.GraphDataModule`'s."""

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

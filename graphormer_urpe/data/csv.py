"""Molecule property tables: a CSV with a SMILES column and one or more target columns.

Targets are regression values or binary labels (0/1; empty = unknown -> NaN). Molecules are
featurized like PCQM4Mv2 (``"ogb"`` featurizer). Rows whose SMILES RDKit rejects are skipped with
ONE warning giving their count and first line numbers; a file with no valid row is an error.
Splits: ``random`` (seeded) or ``scaffold`` (Bemis-Murcko scaffolds, RDKit ``MurckoScaffold``:
molecules sharing a scaffold stay in one split, largest scaffold groups fill train first, as in
DeepChem/chemprop).
"""
from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

SPLIT_NAMES = ("train", "val", "test")
TASKS = ("regression", "classification")


def resolve_columns(path: str | os.PathLike, smiles_column: str = "smiles",
                    target_columns: Sequence[str] | None = None) -> list[str]:
    """The target columns (``None`` = every column but the SMILES), checked against the file's
    header; ``ValueError`` naming the file for a missing file or column."""
    import pandas as pd

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"CSV file {path} does not exist")
    columns = list(pd.read_csv(path, nrows=0).columns)
    if smiles_column not in columns:
        raise ValueError(f"{path} has no SMILES column {smiles_column!r} (columns: {columns})")
    targets = [c for c in columns if c != smiles_column] if target_columns is None else list(target_columns)
    if not targets:
        raise ValueError(f"{path}: no target columns")
    missing = [c for c in targets if c not in columns]
    if missing:
        raise ValueError(f"{path} has no target column(s) {missing} (columns: {columns})")
    return targets


def read_property_csv(path: str | os.PathLike, smiles_column: str = "smiles",
                      target_columns: Sequence[str] | None = None) -> tuple[list[str], np.ndarray, list[str]]:
    """``(smiles [R], y [R, T] float32, target_columns)``; ``target_columns`` None = every other
    column. Raises ``ValueError`` naming the file for a missing or non-numeric column."""
    import pandas as pd

    targets = resolve_columns(path, smiles_column, target_columns)
    table = pd.read_csv(path)
    try:
        y = table[targets].apply(pd.to_numeric, errors="raise").to_numpy(dtype=np.float32)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{path}: target columns {targets} must be numeric ({err})") from None
    smiles = ["" if not isinstance(s, str) else s.strip() for s in table[smiles_column]]
    return smiles, y.reshape(len(smiles), len(targets)), targets


def warn_rejected_rows(path: str | os.PathLike, rejected_rows: np.ndarray, total: int, shown: int = 10) -> None:
    """One warning for all rows whose SMILES RDKit rejected (file line numbers: row + 2)."""
    if len(rejected_rows) == 0:
        return
    lines = ", ".join(str(int(r) + 2) for r in rejected_rows[:shown])
    more = ", ..." if len(rejected_rows) > shown else ""
    message = (f"{path}: skipped {len(rejected_rows)} of {total} rows whose SMILES RDKit rejects "
               f"(lines {lines}{more})")
    log.warning(message)
    warnings.warn(message, stacklevel=2)


def random_split(num_rows: int, fractions: Sequence[float], seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded random ``train/val/test`` row indices with the given fractions."""
    order = np.random.default_rng(seed).permutation(num_rows)
    return dict(zip(SPLIT_NAMES, _cut(order, fractions)))


def murcko_scaffold(smiles: str) -> str:
    """Bemis-Murcko scaffold SMILES (no chirality); ``""`` for acyclic molecules."""
    from rdkit import Chem
    from rdkit.Chem.Scaffolds import MurckoScaffold

    return MurckoScaffold.MurckoScaffoldSmiles(mol=Chem.MolFromSmiles(smiles), includeChirality=False)


def scaffold_split(smiles: Sequence[str], fractions: Sequence[float]) -> dict[str, np.ndarray]:
    """Deterministic scaffold split: scaffold groups, largest first (ties: first occurrence),
    go to train until it would exceed its share, then to val, then test."""
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


def _cut(order: np.ndarray, fractions: Sequence[float]) -> list[np.ndarray]:
    bounds = np.round(np.cumsum(fractions[:2]) * len(order)).astype(int)
    return np.split(order, bounds)


def check_fractions(fractions: Sequence[float]) -> tuple[float, float, float]:
    fractions = tuple(float(f) for f in fractions)
    if len(fractions) != 3 or min(fractions) < 0 or abs(sum(fractions) - 1) > 1e-6:
        raise ValueError(f"split_fractions must be three non-negative numbers summing to 1, got {fractions}")
    return fractions

"""PCQM4Mv2 names of :mod:`.ogb_lsc` (the OGB-LSC layout shared with PCQM4M v1)."""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from graphormer_urpe.data.ogb_lsc import PCQM4MV2, RELEASE_MARKER, allow_numpy_arrays  # noqa: F401
from graphormer_urpe.data import ogb_lsc

FOLDER = PCQM4MV2.folder
SPLITS = PCQM4MV2.splits
TEST_SPLITS = PCQM4MV2.test_splits
URL = PCQM4MV2.url
NUM_MOLECULES = PCQM4MV2.num_molecules


def pcqm4mv2_folder(root: str | os.PathLike) -> Path:
    return PCQM4MV2.path(root)


def read_split_dict(root: str | os.PathLike) -> dict[str, np.ndarray]:
    return ogb_lsc.read_split_dict(root, PCQM4MV2)


def ogb_pcqm4mv2_dataset(root: str | os.PathLike):
    return ogb_lsc.ogb_dataset(root, PCQM4MV2)


def download_pcqm4mv2(root: str | os.PathLike) -> None:
    ogb_lsc.download(root, PCQM4MV2)


def read_pcqm4mv2_table(root: str | os.PathLike) -> tuple[list[str], np.ndarray]:
    return ogb_lsc.read_table(root, PCQM4MV2)


def write_pcqm4mv2_root(root: str | os.PathLike, source_csv: str | os.PathLike,
                        split_sizes: Mapping[str, int] | None = None, seed: int = 0) -> Path:
    """Fixture builder: a PCQM4Mv2 root from real molecules (:func:`~.ogb_lsc.write_root`)."""
    return ogb_lsc.write_root(root, source_csv, PCQM4MV2, split_sizes, seed)

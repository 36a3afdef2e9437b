"""PCQM4Mv2 (OGB-LSC) in its official layout, featurized like OGB's own dataset.

Layout (what OGB's ``pcqm4m-v2.zip`` unpacks to)::

    <root>/pcqm4m-v2/raw/data.csv.gz      columns idx, smiles, homolumogap (NaN in test sets)
    <root>/pcqm4m-v2/split_dict.pt        {"train", "valid", "test-dev", "test-challenge"}:
                                          int64 row indices (numpy arrays, saved with torch.save)
    <root>/pcqm4m-v2/RELEASE_v1.txt       OGB's version marker

Molecules are featurized with ``ogb.utils.smiles2graph`` (the ``"ogb"`` featurizer) in worker
processes, each distinct SMILES once, giving exactly the graphs of ``ogb.lsc.PygPCQM4Mv2Dataset``
(checked by the tests), and kept with their encodings under
``<root>/pcqm4m-v2/processed_graphormer_urpe/``.

OGB calls ``torch.load`` without ``weights_only`` (torch >= 2.6 defaults to True, which rejects
the numpy arrays of ``split_dict.pt``) and asks ``input()`` when a folder lacks its release
marker. :func:`allow_numpy_arrays` admits exactly numpy's array reconstruction for the duration
of a ``with`` block (``weights_only`` stays on, nothing global changes afterwards), and
:func:`ogb_pcqm4mv2_dataset` refuses, with a ``ValueError``, any folder that would make OGB prompt.
"""
from __future__ import annotations

import contextlib
import gzip
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import torch

FOLDER = "pcqm4m-v2"
SPLITS = ("train", "valid", "test-dev", "test-challenge")
TEST_SPLITS = ("test-dev", "test-challenge")
RELEASE_MARKER = "RELEASE_v1.txt"
#: OGB's download (used only when the layout is missing and ``download=True``).
URL = "https://dgl-data.s3-accelerate.amazonaws.com/dataset/OGB-LSC/pcqm4m-v2.zip"
NUM_MOLECULES = 3_746_620


def pcqm4mv2_folder(root: str | os.PathLike) -> Path:
    return Path(root) / FOLDER


def _numpy_array_globals() -> list:
    dtype_classes = [type(np.dtype(t)) for t in ("int64", "int32", "float32", "float64", "bool")]
    core = getattr(np, "_core", None) or np.core
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, *dtype_classes]


def _pyg_data_globals() -> list:
    from torch_geometric.data.data import Data, DataEdgeAttr, DataTensorAttr
    from torch_geometric.data.storage import GlobalStorage

    return [Data, DataEdgeAttr, DataTensorAttr, GlobalStorage]


@contextlib.contextmanager
def allow_numpy_arrays(pyg_data: bool = False) -> Iterator[None]:
    """Within the block, ``torch.load(weights_only=True)`` (the default) also accepts plain numpy
    arrays, as in OGB's ``split_dict.pt`` (and, with ``pyg_data``, PyG's ``Data`` containers, as in
    OGB's processed file); the allow-list is restored on exit."""
    allowed = _numpy_array_globals() + (_pyg_data_globals() if pyg_data else [])
    with torch.serialization.safe_globals(allowed):
        yield


def read_split_dict(root: str | os.PathLike) -> dict[str, np.ndarray]:
    """``split_dict.pt`` as int64 numpy arrays, loaded with ``weights_only=True``."""
    path = pcqm4mv2_folder(root) / "split_dict.pt"
    if not path.is_file():
        raise ValueError(f"PCQM4Mv2 split file {path} is missing (expected the OGB-LSC layout "
                         f"<root>/{FOLDER}/raw/data.csv.gz + <root>/{FOLDER}/split_dict.pt)")
    with allow_numpy_arrays():
        raw = torch.load(path, weights_only=True)
    missing = [s for s in SPLITS if s not in raw]
    if missing:
        raise ValueError(f"{path} lacks splits {missing}")
    return {s: np.asarray(raw[s], dtype=np.int64) for s in SPLITS}


def ogb_pcqm4mv2_dataset(root: str | os.PathLike):
    """OGB's own ``PygPCQM4Mv2Dataset(root)`` and its split dict, never prompting: a folder that
    would make OGB ask (missing release marker or raw file) is a ``ValueError`` instead."""
    from ogb.lsc import PygPCQM4Mv2Dataset

    folder = pcqm4mv2_folder(root)
    if not (folder / RELEASE_MARKER).is_file() or not (folder / "raw" / "data.csv.gz").is_file():
        raise ValueError(f"{folder} is not a complete PCQM4Mv2 folder (needs {RELEASE_MARKER} and "
                         "raw/data.csv.gz); OGB would ask on stdin to update or download it")
    with allow_numpy_arrays(pyg_data=True):
        dataset = PygPCQM4Mv2Dataset(root=str(root))
        return dataset, dataset.get_idx_split()


def download_pcqm4mv2(root: str | os.PathLike) -> None:
    """Fetch and unpack OGB's archive into ``root`` (needs internet; no prompt)."""
    from ogb.utils.url import download_url, extract_zip

    path = download_url(URL, str(root))
    extract_zip(path, str(root))
    os.unlink(path)


def read_pcqm4mv2_table(root: str | os.PathLike) -> tuple[list[str], np.ndarray]:
    """SMILES ``[R]`` and HOMO-LUMO gaps ``[R]`` float32 (NaN in the test sets) of data.csv.gz."""
    import pandas as pd

    path = pcqm4mv2_folder(root) / "raw" / "data.csv.gz"
    table = pd.read_csv(path, usecols=["smiles", "homolumogap"])
    return table["smiles"].tolist(), table["homolumogap"].to_numpy(dtype=np.float32)


def write_pcqm4mv2_root(root: str | os.PathLike, source_csv: str | os.PathLike,
                        split_sizes: Mapping[str, int] | None = None, seed: int = 0) -> Path:
    """Write an OGB-format PCQM4Mv2 root from real molecules (a test / submission fixture).

    ``source_csv`` (e.g. ``shared/data/pcqm4mv2/pcqm4mv2_first2k_3d.csv.gz``) holds explicit-H
    CXSMILES with 3D coordinates (column ``smiles``) and the gap (``homo``); hydrogens are removed
    and plain SMILES written. Without ``split_sizes`` every molecule appears once, split
    80/10/5/5 % at random (``seed``); with ``split_sizes`` (all four splits) the splits are
    consecutive row blocks of those sizes whose molecules cycle through the source, so e.g. the
    official test-dev (147,037) and test-challenge (147,432) sizes cost only the distinct
    molecules' featurization. Test rows get NaN gaps, as in the official file.
    Returns the ``pcqm4m-v2`` folder.
    """
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
    if split_sizes is None:
        order = np.random.default_rng(seed).permutation(num_molecules)
        bounds = np.round(np.cumsum([0.8, 0.1, 0.05]) * num_molecules).astype(int)
        rows = dict(zip(SPLITS, np.split(order, bounds)))
        molecule_of_row = np.arange(num_molecules)
    else:
        if set(split_sizes) != set(SPLITS) or min(split_sizes.values()) < 0:
            raise ValueError(f"split_sizes needs non-negative sizes for exactly {SPLITS}, got {dict(split_sizes)}")
        ends = np.cumsum([split_sizes[s] for s in SPLITS])
        rows = dict(zip(SPLITS, np.split(np.arange(ends[-1]), ends[:-1])))
        molecule_of_row = np.arange(ends[-1]) % num_molecules
    gap_of_row = np.asarray(gaps, dtype=np.float64)[molecule_of_row]
    for split in TEST_SPLITS:
        gap_of_row[rows[split]] = np.nan

    folder = pcqm4mv2_folder(root)
    (folder / "raw").mkdir(parents=True, exist_ok=True)
    table = pd.DataFrame({"idx": np.arange(len(molecule_of_row)),
                          "smiles": np.asarray(smiles, dtype=object)[molecule_of_row],
                          "homolumogap": gap_of_row})
    with gzip.open(folder / "raw" / "data.csv.gz", "wt", compresslevel=1) as f:
        table.to_csv(f, index=False)
    torch.save({s: np.asarray(rows[s], dtype=np.int64) for s in SPLITS}, folder / "split_dict.pt")
    (folder / RELEASE_MARKER).write_text("PCQM4Mv2 fixture in the OGB-LSC layout (graphormer_urpe)\n")
    return folder

"""RDKit 2D descriptors of molecules: computed, cached, clipped to 0.1-99.9 % quantiles and
standardized; pretraining targets, inputs beside a fine-tuned readout and the fast mode's
features. Imports neither Lightning nor the DataModules."""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from graphormer_urpe.data.featurize import map_chunks

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


def descriptor_chunk(smiles: Sequence[str]) -> np.ndarray:
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


def standardize(raw, statistics=None):
    """``raw [R, D]`` clipped, centred and scaled per column with ``statistics``
    (:func:`clip_statistics` of e.g. a training split; default: ``raw``'s own); NaN stays NaN.
    numpy in, float32 numpy out; torch tensors in (the model's input), a tensor out."""
    low, high, mean, std = clip_statistics(raw) if statistics is None else statistics
    out = (raw.clip(low, high) - mean) / std
    return out.astype(np.float32) if isinstance(out, np.ndarray) else out


def raw_descriptors(smiles: Sequence[str], num_workers: int | None = None, chunk_size: int = 2000
                    ) -> Iterator[np.ndarray]:
    """The raw descriptors of ``smiles`` in blocks of ``chunk_size`` rows (float32 ``[rows, D]``,
    NaN where RDKit fails), in order, on worker processes with a progress bar."""
    return map_chunks(descriptor_chunk, smiles, chunk_size, num_workers, "rdkit descriptors")


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

"""On-disk cache of per-split arrays: graph encodings (and featurized graphs) computed once.

A cache entry is a directory of ``.npy`` files plus ``manifest.json``::

    <dir>/manifest.json   {"format": 1, "fingerprint": {...}, "arrays": {name: {dtype, shape}}}
    <dir>/<name>.npy      one array each, opened lazily with ``np.load(mmap_mode="r")``

The fingerprint holds everything the arrays depend on: the parameters (``max_hops``, encoder
version, ...) and the input (sizes and a BLAKE2 hash of ``node_ptr``, ``edge_ptr`` and
``edge_index``). :func:`load_arrays` returns None, so the caller rebuilds, when the entry is
missing, has another fingerprint, or an array file does not match its manifest. :func:`save_arrays`
writes into a temporary sibling directory, fsyncs every file, and renames it into place with
``os.replace``: a killed run leaves at most a stray temporary directory, never an entry that
loads as valid.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

import graphormer_urpe

log = logging.getLogger(__name__)

CACHE_FORMAT = 1
MANIFEST = "manifest.json"


def hash_arrays(*arrays: np.ndarray) -> str:
    """BLAKE2b digest of the arrays' dtypes, shapes and bytes (in order)."""
    digest = hashlib.blake2b(digest_size=16)
    for array in arrays:
        array = np.ascontiguousarray(array)
        digest.update(f"{array.dtype.str}{array.shape}".encode())
        digest.update(memoryview(array).cast("B"))
    return digest.hexdigest()


def graph_input_fingerprint(node_ptr: np.ndarray, edge_index: np.ndarray, edge_ptr: np.ndarray) -> dict:
    """What encodings depend on in the input: sizes and a hash of the graph structure."""
    return {"num_graphs": int(len(node_ptr) - 1), "num_nodes": int(node_ptr[-1]),
            "num_edges": int(edge_ptr[-1]), "structure_hash": hash_arrays(node_ptr, edge_ptr, edge_index)}


def encoder_version() -> str:
    """Version tag of the encoding algorithm (part of every encoding fingerprint)."""
    from graphormer_urpe import algos

    return str(getattr(algos, "ENCODER_VERSION", graphormer_urpe.__version__))


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # not supported on every platform
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_arrays(directory: str | os.PathLike, arrays: dict[str, np.ndarray], fingerprint: dict[str, Any]) -> None:
    """Atomically (re)write the cache entry ``directory`` with ``arrays`` and ``fingerprint``."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    try:
        entries = {}
        for name, array in arrays.items():
            array = np.ascontiguousarray(array)
            with open(tmp / f"{name}.npy", "wb") as f:
                np.save(f, array, allow_pickle=False)
                f.flush()
                os.fsync(f.fileno())
            entries[name] = {"dtype": array.dtype.str, "shape": list(array.shape)}
        manifest = {"format": CACHE_FORMAT, "fingerprint": fingerprint, "arrays": entries}
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if directory.exists():  # a stale entry: move it aside first (os.replace needs an empty target)
            stale = Path(tempfile.mkdtemp(prefix=f".{directory.name}.stale-", dir=directory.parent))
            os.replace(directory, stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
        os.replace(tmp, directory)
        _fsync_dir(directory.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_arrays(directory: str | os.PathLike, fingerprint: dict[str, Any],
                mmap: bool = True) -> dict[str, np.ndarray] | None:
    """The arrays of cache entry ``directory`` (memory-mapped, read-only) if it exists, was written
    with exactly ``fingerprint`` and every file matches the manifest; otherwise None."""
    directory = Path(directory)
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if manifest.get("format") != CACHE_FORMAT or manifest.get("fingerprint") != json.loads(json.dumps(fingerprint)):
        return None
    arrays = {}
    for name, entry in manifest.get("arrays", {}).items():
        try:
            array = np.load(directory / f"{name}.npy", mmap_mode="r" if mmap else None, allow_pickle=False)
        except (OSError, ValueError):  # missing or truncated file
            return None
        if array.dtype.str != entry["dtype"] or list(array.shape) != entry["shape"]:
            return None
        arrays[name] = array
    return arrays


def cached_encodings(directory: str | os.PathLike, node_ptr: np.ndarray, edge_index: np.ndarray,
                     edge_ptr: np.ndarray, max_hops: int, num_threads: int = 1) -> dict[str, np.ndarray]:
    """``spd [P]``, ``path_edges [P, K]``, ``degree [N]``, ``pair_ptr [G + 1]`` of the graphs,
    from the cache entry ``directory`` or computed with ``encode_graphs`` and stored there."""
    from graphormer_urpe.algos import encode_graphs

    node_ptr = np.ascontiguousarray(node_ptr, dtype=np.int64)
    edge_ptr = np.ascontiguousarray(edge_ptr, dtype=np.int64)
    fingerprint = {"kind": "graph encodings", "max_hops": int(max_hops), "encoder_version": encoder_version(),
                   "input": graph_input_fingerprint(node_ptr, edge_index, edge_ptr)}
    arrays = load_arrays(directory, fingerprint)
    if arrays is not None:
        return arrays
    log.info("encoding %d graphs (max_hops=%d) into %s", len(node_ptr) - 1, max_hops, directory)
    encoded = encode_graphs(node_ptr, np.ascontiguousarray(edge_index, dtype=np.int64), edge_ptr,
                            max_hops, num_threads=num_threads)
    arrays = {"spd": encoded.spd, "path_edges": encoded.path_edges.reshape(-1, max_hops),
              "degree": encoded.degree, "pair_ptr": encoded.pair_ptr}
    save_arrays(directory, arrays, fingerprint)
    return load_arrays(directory, fingerprint)

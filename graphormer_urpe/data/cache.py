"""The encoding cache: every graph encoding of a split computed once, streamed into an array
store entry (:mod:`~graphormer_urpe.data.store`).

The entry's fingerprint holds everything the encodings depend on: the encoder's parameters
(``max_hops``, its version, ...) and the input (sizes and a BLAKE2 hash of ``node_ptr``, ``edge_ptr`` and
``edge_index``, or the checksums of the entry they were read from). The encodings are computed
in chunks of graphs (:func:`graph_chunks`), so a split of any size is encoded with bounded memory.
"""
from __future__ import annotations

import logging
import os

import numpy as np

from graphormer_urpe.data.encoding_registry import PATHS, Encoder, EncodingParams
from graphormer_urpe.data.store import EntryWriter, cached_entry, file_items, hash_arrays, whole_memmap

log = logging.getLogger(__name__)


def graph_input_fingerprint(node_ptr: np.ndarray, edge_index: np.ndarray, edge_ptr: np.ndarray) -> dict:
    """What encodings depend on in the input: sizes and a hash of the graph structure."""
    return {"num_graphs": int(len(node_ptr) - 1), "num_nodes": int(node_ptr[-1]),
            "num_edges": int(edge_ptr[-1]), "structure_hash": hash_arrays(node_ptr, edge_ptr, edge_index)}


#: Node pairs encoded per step of a streaming build (bounds its memory: ~2 * (1 + K) bytes each
#: for the shortest paths).
PAIRS_PER_CHUNK = 1 << 22


def graph_chunks(node_ptr: np.ndarray, pairs_per_chunk: int = PAIRS_PER_CHUNK) -> list[tuple[int, int]]:
    """``[(g0, g1), ...]`` consecutive graph ranges of about ``pairs_per_chunk`` node pairs each."""
    n = np.diff(np.asarray(node_ptr, dtype=np.int64))
    pair_end = np.cumsum(n * n)
    bounds, start = [], 0
    while start < len(n):
        base = pair_end[start - 1] if start else 0
        stop = max(int(np.searchsorted(pair_end, base + pairs_per_chunk, side="right")), start + 1)
        bounds.append((start, stop))
        start = stop
    return bounds


def write_encodings(writer: EntryWriter, node_ptr: np.ndarray, edge_index: np.ndarray, edge_ptr: np.ndarray,
                    params: EncodingParams, num_threads: int = 1, progress: bool = False,
                    encoder: Encoder = PATHS) -> None:
    """Stream the arrays of ``encoder`` (its encodings, plus ``pair_ptr`` for one with pair
    encodings) of the graphs into ``writer``, computing :func:`graph_chunks` one at a time
    (inputs read with :func:`read_rows`)."""
    from tqdm import tqdm

    node_ptr = np.asarray(node_ptr, dtype=np.int64)
    edge_ptr = np.asarray(edge_ptr, dtype=np.int64)
    values = ", ".join(f"{k}={v}" for k, v in encoder.values(params).items())
    log.info("encoding %d graphs (%s) into %s", len(node_ptr) - 1, values, writer.directory)
    arrays = {e.name: writer.array(e.name, e.dtype, e.row_shape(params)) for e in encoder.encodings}
    pair_ptr = None
    if any(e.per == "pair" for e in encoder.encodings):
        pair_ptr = writer.array("pair_ptr", np.int64)
        pair_ptr.append(np.zeros(1, np.int64))
    pairs_before = 0
    with tqdm(total=len(node_ptr) - 1, desc=f"encode ({values})", unit="mol", disable=not progress) as bar:
        for g0, g1 in graph_chunks(node_ptr):
            e0, e1 = int(edge_ptr[g0]), int(edge_ptr[g1])
            encoded = encoder.compute(node_ptr[g0:g1 + 1] - node_ptr[g0], _edge_columns(edge_index, e0, e1),
                                      edge_ptr[g0:g1 + 1] - e0, params, num_threads)
            for name, writer_of in arrays.items():
                writer_of.append(encoded[name])
            if pair_ptr is not None:
                pair_ptr.append(encoded["pair_ptr"][1:] + pairs_before)
                pairs_before += int(encoded["pair_ptr"][-1])
            bar.update(g1 - g0)


def _edge_columns(edge_index: np.ndarray, e0: int, e1: int) -> np.ndarray:
    """``edge_index[:, e0:e1]`` as a C-contiguous int64 copy (file reads for a whole memory map)."""
    if whole_memmap(edge_index):
        return np.stack([file_items(edge_index, r * edge_index.shape[1] + e0, e1 - e0)
                         for r in range(edge_index.shape[0])]).astype(np.int64)
    return np.ascontiguousarray(edge_index[:, e0:e1], dtype=np.int64)


def entry_arrays(encoder: Encoder) -> tuple[str, ...]:
    """The arrays of ``encoder``'s cache entry."""
    pairs = ("pair_ptr",) if any(e.per == "pair" for e in encoder.encodings) else ()
    return (*(e.name for e in encoder.encodings), *pairs)


def cached_encodings(directory: str | os.PathLike, node_ptr: np.ndarray, edge_index: np.ndarray,
                     edge_ptr: np.ndarray, params: EncodingParams, num_threads: int = 1,
                     encoder: Encoder = PATHS, input_fingerprint: dict | None = None) -> dict[str, np.ndarray]:
    """The arrays of ``encoder`` (:func:`entry_arrays`; for :data:`~.encoding_registry.PATHS`
    ``spd [P]``, ``path_edges [P, K]``, ``degree [N]``, ``pair_ptr [G + 1]``) of the graphs, from
    the cache entry ``directory`` or computed chunk by chunk and streamed there. The entry is keyed
    by ``input_fingerprint`` (default: :func:`graph_input_fingerprint` of the graphs)."""
    node_ptr = np.ascontiguousarray(node_ptr, dtype=np.int64)
    edge_ptr = np.ascontiguousarray(edge_ptr, dtype=np.int64)
    if input_fingerprint is None:
        input_fingerprint = graph_input_fingerprint(node_ptr, edge_index, edge_ptr)
    fingerprint = encoder.fingerprint(params, input_fingerprint)
    return cached_entry(directory, fingerprint, lambda writer: write_encodings(
        writer, node_ptr, edge_index, edge_ptr, params, num_threads, progress=True, encoder=encoder),
        expect=entry_arrays(encoder))

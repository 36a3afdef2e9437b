"""The cache of encodings: every encoding of a split computed once and streamed into an entry of
the array store (:mod:`~graphormer_urpe.data.array_store`), one entry per encoder
(``<base>/encodings/<split>-<folder>``: ``train-k5``, ``train-rwse16``); and data sets ->
:class:`~.collate.FlatGraphs` with their encodings from there.

An entry's fingerprint holds everything its encodings depend on: the encoder's parameters
(``max_hops``, its version, ...) and the input (sizes and a BLAKE2 hash of ``node_ptr``,
``edge_ptr`` and ``edge_index``, or the checksums of the entry they were read from). The
encodings are computed in chunks of graphs (:func:`graph_chunks`), so a split of any size is
encoded with bounded memory.

:func:`flat_graphs_from_pyg` takes PyG's collated storage, :func:`encode_smiles_store` a
featurized SMILES table of any size, streamed from and into memory-mapped entries; both end in
:func:`~.encode.encode_flat` or :func:`~.encode.flat_graphs`, as graphs encoded in memory do.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from graphormer_urpe.data.array_store import (BLOCK_BYTES, CacheEntry, EntryWriter, cached_entry, file_items,
                                              hash_arrays, read_rows, whole_memmap)
from graphormer_urpe.data.collate import FlatGraphs
from graphormer_urpe.data.encode import encode_flat, flat_graphs
from graphormer_urpe.data.encodings import PATHS, Encoder, EncodingParams
from graphormer_urpe.data.feature_ids import FEATURE_ID_DTYPE, to_shared_ids
from graphormer_urpe.data.featurize import featurizer_spec

log = logging.getLogger(__name__)

#: Node pairs encoded per step of a streaming build (bounds its memory: ~2 * (1 + K) bytes each
#: for the shortest paths).
PAIRS_PER_CHUNK = 1 << 22


def graph_input_fingerprint(node_ptr: np.ndarray, edge_index: np.ndarray, edge_ptr: np.ndarray) -> dict:
    """What encodings depend on in the input: sizes and a hash of the graph structure."""
    return {"num_graphs": int(len(node_ptr) - 1), "num_nodes": int(node_ptr[-1]),
            "num_edges": int(edge_ptr[-1]), "structure_hash": hash_arrays(node_ptr, edge_ptr, edge_index)}


def graph_chunks(node_ptr: np.ndarray, pairs_per_chunk: int | None = None) -> list[tuple[int, int]]:
    """``[(g0, g1), ...]`` consecutive graph ranges of about ``pairs_per_chunk`` node pairs each
    (default :data:`PAIRS_PER_CHUNK`)."""
    pairs_per_chunk = PAIRS_PER_CHUNK if pairs_per_chunk is None else pairs_per_chunk
    n = np.diff(np.asarray(node_ptr, dtype=np.int64))
    pair_end = np.cumsum(n * n)
    bounds, start = [], 0
    while start < len(n):
        base = pair_end[start - 1] if start else 0
        stop = max(int(np.searchsorted(pair_end, base + pairs_per_chunk, side="right")), start + 1)
        bounds.append((start, stop))
        start = stop
    return bounds


def _has_pairs(encoder: Encoder) -> bool:
    return any(e.per == "pair" for e in encoder.encodings)


def entry_arrays(encoder: Encoder) -> tuple[str, ...]:
    """The arrays of ``encoder``'s cache entry: its encodings, and ``pair_ptr`` with pair encodings."""
    return (*(e.name for e in encoder.encodings), *(("pair_ptr",) if _has_pairs(encoder) else ()))


def write_encodings(writer: EntryWriter, node_ptr: np.ndarray, edge_index: np.ndarray, edge_ptr: np.ndarray,
                    params: EncodingParams, num_threads: int = 1, progress: bool = False,
                    encoder: Encoder = PATHS) -> None:
    """Stream the arrays of ``encoder`` (:func:`entry_arrays`) of the graphs into ``writer``,
    computing :func:`graph_chunks` one at a time (inputs read with
    :func:`~.array_store.read_rows`)."""
    from tqdm import tqdm

    node_ptr = np.asarray(node_ptr, dtype=np.int64)
    edge_ptr = np.asarray(edge_ptr, dtype=np.int64)
    values = ", ".join(f"{k}={v}" for k, v in encoder.values(params).items())
    log.info("encoding %d graphs (%s) into %s", len(node_ptr) - 1, values, writer.directory)
    arrays = {e.name: writer.array(e.name, e.dtype, e.row_shape(params)) for e in encoder.encodings}
    pair_ptr = None
    if _has_pairs(encoder):
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


def cached_encodings(directory: str | os.PathLike, node_ptr: np.ndarray, edge_index: np.ndarray,
                     edge_ptr: np.ndarray, params: EncodingParams, num_threads: int = 1,
                     encoder: Encoder = PATHS, input_fingerprint: dict | None = None) -> dict[str, np.ndarray]:
    """The arrays of ``encoder`` (:func:`entry_arrays`; for :data:`~.encodings.PATHS`
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


def encodings_dir(base: str | os.PathLike, split: str, params: EncodingParams, encoder: Encoder = PATHS) -> Path:
    """Where the cache entry of a split's ``encoder`` lives, next to its processed files."""
    return Path(base) / "encodings" / encoder.folder_name(split, params)


def compute_encodings(node_ptr: np.ndarray, edge_index: np.ndarray, edge_ptr: np.ndarray, params: EncodingParams,
                      cache: tuple[str | os.PathLike, str], num_threads: int = 1,
                      input_fingerprint: dict | None = None, skip: Encoder | None = None) -> dict[str, np.ndarray]:
    """The arrays of every encoder ``params`` switch on but ``skip`` (and ``pair_ptr``), each from
    its cache entry ``encodings_dir(*cache, params, encoder)`` (computed and stored there when
    missing or stale; ``input_fingerprint`` replaces hashing the graphs)."""
    arrays: dict[str, np.ndarray] = {}
    for encoder in params.encoders():
        if encoder is not skip:
            arrays.update(cached_encodings(encodings_dir(*cache, params, encoder), node_ptr, edge_index, edge_ptr,
                                           params, num_threads, encoder, input_fingerprint))
    return arrays


def cached_flat(
    x: np.ndarray, node_ptr: np.ndarray, edge_index: np.ndarray, edge_attr: np.ndarray,
    edge_ptr: np.ndarray, y: np.ndarray, *, cache: tuple[str | os.PathLike, str], params: EncodingParams,
    atom_feature_dims: Sequence[int], bond_feature_dims: Sequence[int], num_threads: int = 1,
) -> FlatGraphs:
    """:func:`~.encode.encode_flat` with each encoder's arrays from its cache entry
    ``encodings_dir(*cache, ...)`` (loaded when it matches, else computed and stored there)."""
    encoded = compute_encodings(node_ptr, edge_index, edge_ptr, params, cache, num_threads)
    return encode_flat(x, node_ptr, edge_index, edge_attr, edge_ptr, y, params=params, encoded=encoded,
                       atom_feature_dims=atom_feature_dims, bond_feature_dims=bond_feature_dims)


def flat_graphs_from_pyg(dataset, cache: tuple[str | os.PathLike, str], params: EncodingParams,
                         atom_feature_dims: Sequence[int], bond_feature_dims: Sequence[int],
                         num_threads: int = 1) -> FlatGraphs:
    """:class:`FlatGraphs` of a PyG ``InMemoryDataset`` straight from its collated storage
    (``_data`` + ``slices``: node ids are already local per graph), no per-graph loop; the
    encodings cached under ``cache = (base, split)`` (:func:`cached_flat`)."""
    data, slices = dataset._data, dataset.slices
    if slices is None:  # a dataset of one graph
        slices = {"x": torch.tensor([0, data.num_nodes]), "edge_index": torch.tensor([0, data.edge_index.shape[1]])}
    return cached_flat(
        data.x.numpy(), slices["x"].numpy(), data.edge_index.numpy(), data.edge_attr.numpy(),
        slices["edge_index"].numpy(), data.y.numpy(), cache=cache, params=params,
        atom_feature_dims=atom_feature_dims, bond_feature_dims=bond_feature_dims, num_threads=num_threads,
    )


def encode_smiles_store(arrays: Mapping[str, np.ndarray], cache: tuple[str | os.PathLike, str],
                        params: EncodingParams, featurizer: str, num_threads: int = 1) -> FlatGraphs:
    """:class:`FlatGraphs` of the distinct molecules of a featurized SMILES table
    (:func:`~.featurize.cached_smiles_graphs`); targets live per row, so the store's ``y`` is NaN.

    The shared feature ids and the shortest-path encodings are streamed into ONE cache entry
    (``encodings_dir(*cache, params)``), each other encoder into its own beside it, chunk by
    chunk (inputs read from the featurized entry's files), keyed by that entry's recorded
    checksums: building or loading a store of any size keeps memory bounded, and the returned
    arrays are all memory-mapped (only ``y``, 4 bytes per molecule, is in memory).
    """
    spec = featurizer_spec(featurizer)
    num_graphs = len(arrays["node_ptr"]) - 1
    y = np.full((num_graphs, 1), np.nan, np.float32)
    if not isinstance(arrays, CacheEntry):  # plain in-memory arrays
        return cached_flat(
            arrays["x"], arrays["node_ptr"], arrays["edge_index"], arrays["edge_attr"], arrays["edge_ptr"], y,
            cache=cache, params=params, atom_feature_dims=spec.atom_feature_dims,
            bond_feature_dims=spec.bond_feature_dims, num_threads=num_threads)
    features = {"x": spec.atom_feature_dims, "edge_attr": spec.bond_feature_dims}
    source = {name: arrays.checksums[name] for name in ("node_ptr", "edge_ptr", "edge_index", *features)}
    fingerprint = {**PATHS.fingerprint(params, source), "feature_dims": {k: list(v) for k, v in features.items()}}

    def build(writer) -> None:
        write_encodings(writer, arrays["node_ptr"], arrays["edge_index"], arrays["edge_ptr"], params,
                        num_threads, progress=True)
        for name, dims in features.items():
            raw = arrays[name]
            ids = writer.array(name, FEATURE_ID_DTYPE, raw.shape[1:])
            rows = max(BLOCK_BYTES // max(raw[:1].nbytes, 1), 1)
            for start in range(0, len(raw), rows):
                ids.append(to_shared_ids(read_rows(raw, start, min(start + rows, len(raw))), dims,
                                         "atom" if name == "x" else "bond"))

    encoded = dict(cached_entry(encodings_dir(*cache, params), fingerprint, build,
                                expect=(*entry_arrays(PATHS), *features)))
    encoded.update(compute_encodings(arrays["node_ptr"], arrays["edge_index"], arrays["edge_ptr"],
                                     params, cache, num_threads, source, skip=PATHS))
    return flat_graphs(encoded["x"], arrays["node_ptr"], encoded["edge_attr"], arrays["edge_ptr"], y, encoded,
                        params)

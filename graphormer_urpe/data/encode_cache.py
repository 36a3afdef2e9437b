"""Data sets -> :class:`~.collate.FlatGraphs` with their encodings computed once and cached (one
entry per encoder, ``<base>/encodings/<split>-<folder>``: ``train-k5``, ``train-rwse16``).

:func:`flat_graphs_from_pyg` takes PyG's collated storage, :func:`encode_smiles_store` a
featurized SMILES table of any size, streamed from and into memory-mapped cache entries; both
end in :func:`~.encode.encode_flat` or :func:`~.encode.flat_graphs`, as graphs encoded in
memory do.
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from graphormer_urpe.data.cache import cached_encodings, entry_arrays, write_encodings
from graphormer_urpe.data.collate import FlatGraphs
from graphormer_urpe.data.encode import encode_flat, flat_graphs
from graphormer_urpe.data.encoding_registry import PATHS, Encoder, EncodingParams
from graphormer_urpe.data.feature_ids import FEATURE_ID_DTYPE, to_shared_ids
from graphormer_urpe.data.featurize import featurizer_spec
from graphormer_urpe.data.store import BLOCK_BYTES, CacheEntry, cached_entry, read_rows


def encodings_dir(base: str | os.PathLike, split: str, params: EncodingParams, encoder: Encoder = PATHS) -> Path:
    """Where the cache entry of a split's ``encoder`` lives, next to its processed files."""
    return Path(base) / "encodings" / encoder.folder_name(split, params)


def compute_encodings(node_ptr: np.ndarray, edge_index: np.ndarray, edge_ptr: np.ndarray, params: EncodingParams,
                      cache: tuple[str | os.PathLike, str], num_threads: int = 1,
                      input_fingerprint: dict | None = None, skip: Encoder | None = None) -> dict[str, np.ndarray]:
    """The arrays of every encoder ``params`` switch on but ``skip`` (and ``pair_ptr``), each from
    its cache entry ``encodings_dir(*cache, params, encoder)`` (computed and stored there when
    missing or stale; ``input_fingerprint`` replaces hashing the graphs)."""
    node_ptr = np.ascontiguousarray(node_ptr, dtype=np.int64)
    edge_ptr = np.ascontiguousarray(edge_ptr, dtype=np.int64)
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

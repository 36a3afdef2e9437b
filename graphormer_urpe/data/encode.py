"""Raw graphs -> :class:`~.collate.FlatGraphs`: shared feature ids plus the encodings that
:class:`~.encoding_registry.EncodingParams` switch on, computed once and cached (one entry per
encoder, ``<base>/encodings/<split>-<folder>``: ``train-k5``, ``train-rwse16``) or, for a few
graphs, in memory.

Every source takes one road: :func:`encode_flat` for raw flat arrays (PyG's collated storage
through :func:`flat_graphs_from_pyg`, a featurized chunk at prediction time) and
:func:`encode_smiles_store` for a featurized SMILES table of any size, streamed from and into
memory-mapped cache entries. :func:`collate_pyg_graphs` encodes and collates a handful of
``torch_geometric.data.Data`` graphs in one call (small inputs, test fixtures).
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from graphormer_urpe.data.batch import GraphBatch
from graphormer_urpe.data.cache import cached_encodings, entry_arrays, write_encodings
from graphormer_urpe.data.collate import FlatGraphs, collate
from graphormer_urpe.data.encoding_registry import PATHS, Encoder, EncodingParams
from graphormer_urpe.data.feature_ids import FEATURE_ID_DTYPE, to_shared_ids
from graphormer_urpe.data.featurize import featurizer_spec
from graphormer_urpe.data.store import BLOCK_BYTES, CacheEntry, cached_entry, read_rows


def encodings_dir(base: str | os.PathLike, split: str, params: EncodingParams, encoder: Encoder = PATHS) -> Path:
    """Where the cache entry of a split's ``encoder`` lives, next to its processed files."""
    return Path(base) / "encodings" / encoder.folder_name(split, params)


def _flat_graphs(x_ids: np.ndarray, node_ptr: np.ndarray, edge_attr_ids: np.ndarray, edge_ptr: np.ndarray,
                 y: np.ndarray, encoded: Mapping[str, np.ndarray], params: EncodingParams) -> FlatGraphs:
    """:class:`FlatGraphs` of shared feature ids, targets and the arrays of every encoder of
    ``params`` (``encoded``: their names and ``pair_ptr``)."""
    return FlatGraphs(x=x_ids, node_ptr=node_ptr, edge_attr=edge_attr_ids, edge_ptr=edge_ptr,
                      y=np.asarray(y, dtype=np.float32).reshape(len(node_ptr) - 1, -1),
                      pair_ptr=encoded["pair_ptr"], encodings={e.name: encoded[e.name] for e in params.encodings()})


def compute_encodings(node_ptr: np.ndarray, edge_index: np.ndarray, edge_ptr: np.ndarray, params: EncodingParams,
                      num_threads: int = 1, cache: tuple[str | os.PathLike, str] | None = None,
                      input_fingerprint: dict | None = None, skip: Encoder | None = None) -> dict[str, np.ndarray]:
    """The arrays of every encoder ``params`` switch on but ``skip`` (and ``pair_ptr``), each from
    its cache entry ``encodings_dir(*cache, params, encoder)`` (computed and stored there when
    missing or stale; ``input_fingerprint`` replaces hashing the graphs), or in memory with
    ``cache=None``."""
    node_ptr = np.ascontiguousarray(node_ptr, dtype=np.int64)
    edge_ptr = np.ascontiguousarray(edge_ptr, dtype=np.int64)
    arrays: dict[str, np.ndarray] = {}
    for encoder in params.encoders():
        if encoder is skip:
            continue
        if cache is None:
            arrays.update(encoder.compute(node_ptr, np.ascontiguousarray(edge_index, dtype=np.int64), edge_ptr,
                                          params, num_threads))
        else:
            arrays.update(cached_encodings(encodings_dir(*cache, params, encoder), node_ptr, edge_index, edge_ptr,
                                           params, num_threads, encoder, input_fingerprint))
    return arrays


def encode_flat(
    x: np.ndarray, node_ptr: np.ndarray, edge_index: np.ndarray, edge_attr: np.ndarray,
    edge_ptr: np.ndarray, y: np.ndarray, *, params: EncodingParams, atom_feature_dims: Sequence[int],
    bond_feature_dims: Sequence[int], num_threads: int = 1, cache: tuple[str | os.PathLike, str] | None = None,
) -> FlatGraphs:
    """Featurize (shared ids) and encode raw flat graphs.

    Args:
        x: ``[sum n, F]`` (or ``[sum n]``) raw atom feature values, column c in ``[0, dims[c])``.
        node_ptr, edge_ptr: ``[G + 1]`` offsets.
        edge_index: ``[2, sum E]`` directed edges, LOCAL node ids per graph.
        edge_attr: ``[sum E, Fe]`` (or ``[sum E]``) raw bond feature values.
        y: ``[G, T]`` (or ``[G]``) targets.
        params: which encodings, with which parameters.
        num_threads: encoder threads.
        cache: ``(base, split)``: each encoder's cache entry is ``encodings_dir(base, split, ...)``
            (loaded when it matches, else computed and stored there); None computes them in memory.
    """
    node_ptr = np.ascontiguousarray(node_ptr, dtype=np.int64)
    edge_ptr = np.ascontiguousarray(edge_ptr, dtype=np.int64)
    encoded = compute_encodings(node_ptr, edge_index, edge_ptr, params, num_threads, cache)
    return _flat_graphs(to_shared_ids(x, atom_feature_dims, "atom"), node_ptr,
                        to_shared_ids(edge_attr, bond_feature_dims, "bond"), edge_ptr, y, encoded, params)


def flat_graphs_from_pyg(dataset, cache: tuple[str | os.PathLike, str], params: EncodingParams,
                         atom_feature_dims: Sequence[int], bond_feature_dims: Sequence[int],
                         num_threads: int = 1) -> FlatGraphs:
    """:class:`FlatGraphs` of a PyG ``InMemoryDataset`` straight from its collated storage
    (``_data`` + ``slices``: node ids are already local per graph), no per-graph loop; the
    encodings cached under ``cache = (base, split)`` (:func:`encode_flat`)."""
    data, slices = dataset._data, dataset.slices
    if slices is None:  # a dataset of one graph
        slices = {"x": torch.tensor([0, data.num_nodes]), "edge_index": torch.tensor([0, data.edge_index.shape[1]])}
    return encode_flat(
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
        return encode_flat(
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
                                     params, num_threads, cache, source, skip=PATHS))
    return _flat_graphs(encoded["x"], arrays["node_ptr"], encoded["edge_attr"], arrays["edge_ptr"], y, encoded,
                        params)


def collate_pyg_graphs(data_list: Sequence, params: EncodingParams | int, atom_feature_dims: Sequence[int],
                       bond_feature_dims: Sequence[int]) -> GraphBatch:
    """Encode (in memory) and collate a few ``torch_geometric.data.Data`` graphs: small inputs
    and test fixtures; datasets go through :func:`flat_graphs_from_pyg` and its cache.

    Each ``Data`` needs ``x`` (``[n, F]`` or ``[n]`` raw values), ``edge_index`` (``[2, E]``),
    ``edge_attr`` (``[E, Fe]`` or ``[E]``) and optionally ``y`` (``T`` values; missing -> NaN).
    ``params`` may be just ``max_hops``.
    """
    if not isinstance(params, EncodingParams):
        params = EncodingParams(max_hops=params)
    if len(data_list) == 0:
        raise ValueError("collate_pyg_graphs needs at least one graph")
    n = np.array([int(d.num_nodes) for d in data_list], dtype=np.int64)
    e = np.array([int(d.edge_index.shape[1]) for d in data_list], dtype=np.int64)
    num_bond_cols = len(bond_feature_dims)
    ys = [None if getattr(d, "y", None) is None else d.y.reshape(-1).numpy() for d in data_list]
    num_targets = max((len(v) for v in ys if v is not None), default=1)
    y = np.stack([np.full(num_targets, np.nan, np.float32) if v is None else v for v in ys])
    flat = encode_flat(
        x=np.concatenate([d.x.numpy().reshape(int(d.num_nodes), -1) for d in data_list]),
        node_ptr=np.concatenate([[0], np.cumsum(n)]),
        edge_index=np.concatenate([d.edge_index.numpy() for d in data_list], axis=1),
        edge_attr=np.concatenate([d.edge_attr.numpy().reshape(-1, num_bond_cols) for d in data_list]),
        edge_ptr=np.concatenate([[0], np.cumsum(e)]),
        y=y, params=params,
        atom_feature_dims=atom_feature_dims, bond_feature_dims=bond_feature_dims,
    )
    return collate(flat, np.arange(len(data_list)))

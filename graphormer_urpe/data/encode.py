"""Raw graphs -> :class:`~.collate.FlatGraphs` in memory: shared feature ids plus the encodings
that :class:`~.encodings.EncodingParams` switch on.

:func:`encode_flat` takes raw flat arrays (a featurized chunk at prediction time; with
``encoded`` given, a data set whose encodings come from the cache, :mod:`.encoding_cache`);
:func:`collate_pyg_graphs` encodes and collates a handful of ``torch_geometric.data.Data``
graphs in one call (small inputs, test fixtures). Nothing here reads or writes files.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from graphormer_urpe.data.batch import GraphBatch
from graphormer_urpe.data.collate import FlatGraphs, collate
from graphormer_urpe.data.encodings import Encoder, EncodingParams
from graphormer_urpe.data.feature_ids import to_shared_ids


def flat_graphs(x_ids: np.ndarray, node_ptr: np.ndarray, edge_attr_ids: np.ndarray, edge_ptr: np.ndarray,
                 y: np.ndarray, encoded: Mapping[str, np.ndarray], params: EncodingParams) -> FlatGraphs:
    """:class:`FlatGraphs` of shared feature ids, targets and the arrays of every encoder of
    ``params`` (``encoded``: their names and ``pair_ptr``)."""
    return FlatGraphs(x=x_ids, node_ptr=node_ptr, edge_attr=edge_attr_ids, edge_ptr=edge_ptr,
                      y=np.asarray(y, dtype=np.float32).reshape(len(node_ptr) - 1, -1),
                      pair_ptr=encoded["pair_ptr"], encodings={e.name: encoded[e.name] for e in params.encodings()})


def encode_arrays(node_ptr: np.ndarray, edge_index: np.ndarray, edge_ptr: np.ndarray, params: EncodingParams,
                  num_threads: int = 1, skip: Encoder | None = None) -> dict[str, np.ndarray]:
    """The arrays of every encoder ``params`` switch on but ``skip`` (and ``pair_ptr``), computed
    in memory."""
    node_ptr = np.ascontiguousarray(node_ptr, dtype=np.int64)
    edge_ptr = np.ascontiguousarray(edge_ptr, dtype=np.int64)
    edge_index = np.ascontiguousarray(edge_index, dtype=np.int64)
    arrays: dict[str, np.ndarray] = {}
    for encoder in params.encoders():
        if encoder is not skip:
            arrays.update(encoder.compute(node_ptr, edge_index, edge_ptr, params, num_threads))
    return arrays


def encode_flat(
    x: np.ndarray, node_ptr: np.ndarray, edge_index: np.ndarray, edge_attr: np.ndarray,
    edge_ptr: np.ndarray, y: np.ndarray, *, params: EncodingParams, atom_feature_dims: Sequence[int],
    bond_feature_dims: Sequence[int], num_threads: int = 1, encoded: Mapping[str, np.ndarray] | None = None,
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
        encoded: the encoders' arrays already computed (a cache's), else computed here
            (:func:`encode_arrays`).
    """
    node_ptr = np.ascontiguousarray(node_ptr, dtype=np.int64)
    edge_ptr = np.ascontiguousarray(edge_ptr, dtype=np.int64)
    if encoded is None:
        encoded = encode_arrays(node_ptr, edge_index, edge_ptr, params, num_threads)
    return flat_graphs(to_shared_ids(x, atom_feature_dims, "atom"), node_ptr,
                       to_shared_ids(edge_attr, bond_feature_dims, "bond"), edge_ptr, y, encoded, params)


def collate_pyg_graphs(data_list: Sequence, params: EncodingParams | int, atom_feature_dims: Sequence[int],
                       bond_feature_dims: Sequence[int]) -> GraphBatch:
    """Encode (in memory) and collate a few ``torch_geometric.data.Data`` graphs: small inputs
    and test fixtures; data sets go through :func:`~.encoding_cache.flat_graphs_from_pyg` and its cache.

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

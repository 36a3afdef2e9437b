r"""Categorical feature columns mapped into one shared embedding-id space per kind: column ``c``'s
ids are offset past the vocabularies of the columns before it and by one more, so id 0 is
padding: ``id(c, v) = 1 + sum(dims[:c]) + v``, table size ``1 + sum(dims)``."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

#: dtype of stored shared ids: every vocabulary used here (ZINC 28 + 4, OGB 173 + 13) fits.
FEATURE_ID_DTYPE = np.int16


def num_embeddings(feature_dims: Sequence[int]) -> int:
    """Size of the shared embedding table for columns of vocabulary sizes ``feature_dims``,
    including the padding id 0."""
    return 1 + int(sum(int(d) for d in feature_dims))


def feature_offsets(feature_dims: Sequence[int]) -> np.ndarray:
    """``[F]`` int64: the shared id of value 0 in each column (``1 + sum of earlier dims``)."""
    dims = np.asarray(feature_dims, dtype=np.int64).reshape(-1)
    if dims.size == 0 or (dims <= 0).any():
        raise ValueError(f"feature_dims must be a non-empty list of positive sizes, got {list(feature_dims)}")
    return 1 + np.concatenate([[0], np.cumsum(dims)[:-1]])


def check_integer_features(raw: np.ndarray, kind: str) -> None:
    """``ValueError`` unless ``raw`` holds integers (a float would be truncated to an id, NaN become one)."""
    if not np.issubdtype(raw.dtype, np.integer):
        raise ValueError(f"{kind} features are {raw.dtype}, not integers: Graphormer embeds each "
                         "column as ids of a vocabulary (e.g. atom types); convert features that "
                         "hold ids with .long(), and make continuous ones categories")


def to_shared_ids(raw: np.ndarray, feature_dims: Sequence[int], kind: str = "atom") -> np.ndarray:
    """Raw per-column values ``[M, F]`` (or ``[M]``) as shared ids ``[M, F]``; ``ValueError`` naming
    the column for a value outside ``[0, dims[c])`` (it would alias another column) or not an integer."""
    raw = np.asarray(raw)
    check_integer_features(raw, kind)
    if raw.ndim == 1:
        raw = raw.reshape(-1, 1)
    offsets = feature_offsets(feature_dims)
    if raw.ndim != 2 or raw.shape[1] != offsets.size:
        raise ValueError(f"{kind} features have shape {raw.shape}, expected [M, {offsets.size}] "
                         f"for feature_dims={list(feature_dims)}")
    if raw.shape[0]:
        low, high = raw.min(axis=0), raw.max(axis=0)
        dims = np.asarray(feature_dims)
        bad = np.flatnonzero((low < 0) | (high >= dims))
        if bad.size:
            c = int(bad[0])
            raise ValueError(f"{kind} feature column {c} has values in [{low[c]}, {high[c]}], "
                             f"outside its vocabulary [0, {dims[c]})")
    if num_embeddings(feature_dims) > np.iinfo(FEATURE_ID_DTYPE).max:
        raise ValueError(f"{kind} vocabulary of {num_embeddings(feature_dims)} ids does not fit "
                         f"{np.dtype(FEATURE_ID_DTYPE).name}")
    return (raw.astype(np.int64) + offsets).astype(FEATURE_ID_DTYPE)

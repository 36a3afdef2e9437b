r"""The structural encodings stored per node or per node pair: one spec each (:class:`Encoding`),
the computations that produce them (:class:`Encoder`), their parameters
(:class:`EncodingParams`) and their cache (one array-store entry per encoder and split).

A node encoding is stored as ``[sum_g n_g, *S]``, a pair encoding as ``[sum_g n_g^2, *S]`` (pair
``(i, j)`` of graph ``g`` at ``pair_ptr[g] + i n + j``), ``S = (w,)`` with a width, else ``()``;
in a batch ``[B, N, *S]`` / ``[B, N, N, *S]``, ``fill`` at padding. Adding one: docs/data.md."""
from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np

from graphormer_urpe.data import algos
from graphormer_urpe.data.algos import UNREACHABLE
from graphormer_urpe.data.array_store import EntryWriter, cached_entry, hash_arrays, read_items

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Encoding:
    """One stored structural encoding: ``name`` (its key everywhere, and its file in the cache),
    ``per`` node or pair, stored ``dtype`` and ``batch_dtype``, ``fill`` at padding, ``width`` (the
    :class:`EncodingParams` field giving its trailing size; None: one value each), ``edge_ids``
    (LOCAL edge ids, shifted to batch ``edge_attr`` rows) and ``embedded`` (the model adds a linear
    embedding of it to the node features, through ``node_encodings``)."""

    name: str
    per: str
    dtype: type
    batch_dtype: type
    fill: int | float
    width: str | None = None
    edge_ids: bool = False
    embedded: bool = False

    def __post_init__(self) -> None:
        if self.per not in ("node", "pair"):
            raise ValueError(f"encoding {self.name!r}: per must be 'node' or 'pair', got {self.per!r}")

    def row_shape(self, params: "EncodingParams") -> tuple[int, ...]:
        """Trailing shape of one node's / pair's values."""
        return (int(getattr(params, self.width)),) if self.width else ()


#: ``compute(node_ptr, edge_index, edge_ptr, params, num_threads) -> {name: array}``, stored layout.
ComputeFn = Callable[[np.ndarray, np.ndarray, np.ndarray, "EncodingParams", int], dict]


@dataclass(frozen=True)
class Encoder:
    """One computation of encodings, cached as one entry: it runs when all its ``params`` are > 0,
    which with ``version`` (bump it when the output for one input changes) key its cache and, with
    ``folder`` (``"k{max_hops}"``), name it."""

    name: str
    encodings: tuple[Encoding, ...]
    params: tuple[str, ...]
    compute: ComputeFn
    folder: str
    version: Callable[[], str]

    def values(self, params: "EncodingParams") -> dict[str, int]:
        return {p: int(getattr(params, p)) for p in self.params}

    def fingerprint(self, params: "EncodingParams", input_fingerprint: dict) -> dict:
        """What its cached arrays depend on."""
        # "graph encodings": the kind of the shortest-path entries written before there were others
        kind = "graph encodings" if self is PATHS else f"{self.name} encodings"
        return {"kind": kind, **self.values(params), "encoder_version": self.version(),
                "input": input_fingerprint}


def _shortest_paths(node_ptr, edge_index, edge_ptr, params, num_threads) -> dict[str, np.ndarray]:
    return algos.encode_graphs(node_ptr, edge_index, edge_ptr, params.max_hops, num_threads=num_threads)


def random_walk_return_probabilities(node_ptr: np.ndarray, edge_index: np.ndarray, edge_ptr: np.ndarray,
                                     steps: int) -> np.ndarray:
    r"""RWSE (GraphGPS): ``[sum n, steps]`` float32, :math:`(P^k)_{ii}` for ``k = 1..steps``,
    ``P = D^-1 A`` (a node without edges gets 0s); graphs of one size are multiplied together."""
    node_ptr = np.asarray(node_ptr, dtype=np.int64)
    edge_ptr = np.asarray(edge_ptr, dtype=np.int64)
    n = np.diff(node_ptr)
    out = np.zeros((int(node_ptr[-1]), steps), dtype=np.float32)
    owner = np.repeat(np.arange(len(n)), np.diff(edge_ptr))
    for size in np.unique(n[n > 0]):
        graphs = np.flatnonzero(n == size)
        slot = np.full(len(n), -1)
        slot[graphs] = np.arange(len(graphs))
        mine = slot[owner] >= 0
        cell = (slot[owner[mine]] * size + edge_index[0, mine]) * size + edge_index[1, mine]
        adjacency = np.bincount(cell, minlength=len(graphs) * size * size).astype(np.float64)
        adjacency = adjacency.reshape(len(graphs), size, size)
        degree = adjacency.sum(axis=2, keepdims=True)
        walk = np.divide(adjacency, degree, out=np.zeros_like(adjacency), where=degree > 0)
        power = walk
        rows = (node_ptr[graphs][:, None] + np.arange(size)).reshape(-1)
        for k in range(steps):
            out[rows, k] = np.diagonal(power, axis1=1, axis2=2).reshape(-1)
            if k + 1 < steps:
                power = power @ walk
    return out


def _rwse(node_ptr, edge_index, edge_ptr, params, num_threads) -> dict[str, np.ndarray]:
    return {"rwse": random_walk_return_probabilities(node_ptr, edge_index, edge_ptr, params.rwse_steps)}


#: Edges kept per shortest path (``K``) when a run does not say.
DEFAULT_MAX_HOPS = 5


@dataclass(frozen=True)
class EncodingParams:
    """Every encoding parameter: ``max_hops`` (``K``, edges kept per shortest path) and ``rwse_steps``
    (random-walk steps of :data:`RWSE`, 0: off)."""

    max_hops: int = DEFAULT_MAX_HOPS
    rwse_steps: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"{f.name} must be an int >= 0, got {value!r}")
        if self.max_hops < 1:
            raise ValueError(f"max_hops must be >= 1, got {self.max_hops}")

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def describe(self) -> str:
        return ", ".join(f"{name}={value}" for name, value in self.as_dict().items())

    def encoders(self) -> tuple[Encoder, ...]:
        """The encoders these parameters switch on."""
        return tuple(e for e in ENCODERS if all(getattr(self, p) > 0 for p in e.params))

    def encodings(self) -> tuple[Encoding, ...]:
        """Every encoding a batch of these parameters carries."""
        return tuple(enc for e in self.encoders() for enc in e.encodings)

    def node_encodings(self) -> dict[str, int]:
        """``{name: width}`` of the encodings the model embeds linearly (its ``node_encodings``)."""
        return {enc.name: enc.row_shape(self)[0] for enc in self.encodings() if enc.embedded}

    @classmethod
    def of_model(cls, max_hops: int, node_encodings: Mapping[str, int] | None = None) -> "EncodingParams":
        """The parameters of the data a model of these facts reads (a checkpoint's hyperparameters
        ``max_hops`` and ``node_encodings``)."""
        params = cls(max_hops=int(max_hops))
        for name, width in (node_encodings or {}).items():
            encoding = ENCODING_BY_NAME.get(name)
            if encoding is None or not encoding.embedded:
                raise ValueError(f"node_encodings names {name!r}, which is not an embedded encoding; "
                                 f"known: {sorted(n for n, e in ENCODING_BY_NAME.items() if e.embedded)}")
            params = replace(params, **{encoding.width: int(width)})
        return params


#: The Cython encoder (:mod:`graphormer_urpe.data.algos`): always on.
PATHS = Encoder(
    "paths",
    (
        Encoding("degree", "node", np.int16, np.int16, fill=0),
        Encoding("spd", "pair", np.int16, np.int16, fill=UNREACHABLE),
        Encoding("path_edges", "pair", np.int16, np.int32, fill=-1, width="max_hops", edge_ids=True),
    ),
    ("max_hops",), _shortest_paths, folder="k{max_hops}", version=lambda: algos.ENCODER_VERSION)
#: Random-walk structural encoding, :func:`random_walk_return_probabilities`.
RWSE = Encoder(
    "rwse", (Encoding("rwse", "node", np.float32, np.float32, fill=0.0, width="rwse_steps", embedded=True),),
    ("rwse_steps",), _rwse, folder="rwse{rwse_steps}", version=lambda: "1")

ENCODERS: tuple[Encoder, ...] = (PATHS, RWSE)
ENCODINGS: tuple[Encoding, ...] = tuple(enc for e in ENCODERS for enc in e.encodings)
ENCODING_BY_NAME: dict[str, Encoding] = {e.name: e for e in ENCODINGS}
#: The encodings every batch carries (those of :data:`PATHS`), in their order.
CORE_ENCODINGS: tuple[str, ...] = tuple(e.name for e in PATHS.encodings)


#: Node pairs encoded per step of a streaming build (bounds its memory).
PAIRS_PER_CHUNK = 1 << 22


def graph_chunks(node_ptr: np.ndarray, pairs_per_chunk: int | None = None) -> list[tuple[int, int]]:
    """Consecutive graph ranges ``[(g0, g1), ...]`` of about ``pairs_per_chunk`` node pairs each."""
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
    """Stream the arrays of ``encoder`` (:func:`entry_arrays`) into ``writer``, one
    :func:`graph_chunks` range at a time."""
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
            edges = np.stack([read_items(edge_index, r * edge_index.shape[1] + e0, e1 - e0)  # C-contiguous
                              for r in range(edge_index.shape[0])]).astype(np.int64)
            encoded = encoder.compute(node_ptr[g0:g1 + 1] - node_ptr[g0], edges, edge_ptr[g0:g1 + 1] - e0, params,
                                      num_threads)
            for name, writer_of in arrays.items():
                writer_of.append(encoded[name])
            if pair_ptr is not None:
                pair_ptr.append(encoded["pair_ptr"][1:] + pairs_before)
                pairs_before += int(encoded["pair_ptr"][-1])
            bar.update(g1 - g0)


def cached_encodings(directory: str | os.PathLike, node_ptr: np.ndarray, edge_index: np.ndarray,
                     edge_ptr: np.ndarray, params: EncodingParams, num_threads: int = 1,
                     encoder: Encoder = PATHS, input_fingerprint: dict | None = None) -> dict[str, np.ndarray]:
    """The arrays of ``encoder`` (:func:`entry_arrays`), from the cache entry ``directory`` or
    computed and streamed there, keyed by ``input_fingerprint`` (default: the graphs' hash)."""
    node_ptr = np.ascontiguousarray(node_ptr, dtype=np.int64)
    edge_ptr = np.ascontiguousarray(edge_ptr, dtype=np.int64)
    if input_fingerprint is None:  # sizes and a hash of the graph structure
        input_fingerprint = {"num_graphs": int(len(node_ptr) - 1), "num_nodes": int(node_ptr[-1]),
                             "num_edges": int(edge_ptr[-1]),
                             "structure_hash": hash_arrays(node_ptr, edge_ptr, edge_index)}
    fingerprint = encoder.fingerprint(params, input_fingerprint)
    return cached_entry(directory, fingerprint, lambda writer: write_encodings(
        writer, node_ptr, edge_index, edge_ptr, params, num_threads, progress=True, encoder=encoder),
        expect=entry_arrays(encoder))


def encodings_dir(base: str | os.PathLike, split: str, params: EncodingParams, encoder: Encoder = PATHS) -> Path:
    """Where the cache entry of a split's ``encoder`` lives, next to its processed files."""
    return Path(base) / "encodings" / f"{split}-{encoder.folder.format(**encoder.values(params))}"


def encode(node_ptr: np.ndarray, edge_index: np.ndarray, edge_ptr: np.ndarray, params: EncodingParams,
           num_threads: int = 1, cache: tuple[str | os.PathLike, str] | None = None,
           input_fingerprint: dict | None = None, skip: Encoder | None = None) -> dict[str, np.ndarray]:
    """The arrays of every encoder ``params`` switch on but ``skip``: in memory, or with ``cache =
    (base, split)`` each through its cache entry (``input_fingerprint`` replaces hashing the graphs)."""
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

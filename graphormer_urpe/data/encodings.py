r"""The structural encodings stored per node or per node pair: one spec each, in one registry.

An :class:`Encoding` is one array: per node or per pair, its dtype (stored and batched), its
padding value and the parameter that sets its width. An :class:`Encoder` is one computation
producing one or more encodings from the graph structure, with its parameters: they name its
cache entry's folder and make its fingerprint (:mod:`.encoding_cache`). :class:`EncodingParams` holds every
parameter; the encoders a run computes are those its parameters switch on
(:meth:`EncodingParams.encoders`). Collation (:func:`~.collate.collate`), the device gather
(:func:`~.resident.gather_batch`), the cache (:func:`~.encoding_cache.cached_encodings`), the checks of
:class:`~.collate.FlatGraphs` and of the model
(:meth:`graphormer_urpe.nn.graphormer.Graphormer.check_encodings`) loop over the encodings a
batch carries, by name.

Storage, for a graph of ``n`` nodes stored from node row ``node_ptr[g]`` and pair row
``pair_ptr[g]`` (pair ``(i, j)`` at ``pair_ptr[g] + i n + j``):

.. math::
    \text{node encoding: } [\textstyle\sum_g n_g, *S], \qquad
    \text{pair encoding: } [\textstyle\sum_g n_g^2, *S], \qquad S = (w,) \text{ with a width, else } ()

and in a batch ``[B, N, *S]`` / ``[B, N, N, *S]``, ``fill`` at padded nodes and pairs. Values
that are LOCAL edge ids (``edge_ids``) become rows of the batch's ``edge_attr`` by adding the
number of edges of the graphs before it in the batch; ``-1`` (no edge) stays ``-1``.

Adding an encoding (the random-walk encoding :data:`RWSE` is the worked example):

1. a field of :class:`EncodingParams` for its parameter, default "off" (``rwse_steps: int = 0``);
2. its compute function (flat graphs -> ``{name: array}`` in the layout above) and an
   :class:`Encoder` in :data:`ENCODERS` naming the parameter;
3. an init argument of the same name on :class:`~.datamodule.GraphDataModule`.

A per-node float encoding needs nothing on the model's side: the DataModule links its width into
the model (``node_encodings``), which adds a linear embedding of it to the atom features.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields, replace

import numpy as np

from graphormer_urpe.data import algos
from graphormer_urpe.data.algos import UNREACHABLE


@dataclass(frozen=True)
class Encoding:
    """One stored structural encoding.

    Attributes:
        name: its key in ``FlatGraphs.encodings``, ``GraphBatch.encodings``, the encoder's result
            and the cache (the array's file name).
        per: ``"node"`` or ``"pair"``.
        dtype: stored dtype (``FlatGraphs``, cache).
        batch_dtype: dtype in ``GraphBatch``.
        fill: the value at padded nodes / pairs of a batch.
        width: the :class:`EncodingParams` field giving its trailing size (one column each);
            ``None``: one value per node / pair.
        edge_ids: values are LOCAL edge ids (``-1`` = none), shifted to batch ``edge_attr`` rows.
        embedded: the model embeds it with a linear map added to the node features (a per-node
            float encoding linked through ``node_encodings``); the built-in ones are embedded
            by their own modules.
    """

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


#: ``compute(node_ptr, edge_index, edge_ptr, params, num_threads) -> {name: array}``: flat graphs
#: (as :func:`graphormer_urpe.data.algos.encode_graphs` takes them) to the encoder's arrays, stored layout.
ComputeFn = Callable[[np.ndarray, np.ndarray, np.ndarray, "EncodingParams", int], dict]


@dataclass(frozen=True)
class Encoder:
    """One computation of encodings, cached as one entry.

    Attributes:
        name: its name in messages.
        encodings: what it produces.
        params: the :class:`EncodingParams` fields it depends on: they make its cache fingerprint
            and folder name (``<split>-<folder>``), and it runs only when all are > 0.
        compute: see :data:`ComputeFn`.
        folder: the folder-name suffix, formatted with ``params`` (``"k{max_hops}"``).
        version: returns the version tag; bump it when the output for the same input changes
            (caches are keyed by it).
    """

    name: str
    encodings: tuple[Encoding, ...]
    params: tuple[str, ...]
    compute: ComputeFn
    folder: str
    version: Callable[[], str]

    def values(self, params: "EncodingParams") -> dict[str, int]:
        return {p: int(getattr(params, p)) for p in self.params}

    def folder_name(self, split: str, params: "EncodingParams") -> str:
        return f"{split}-{self.folder.format(**self.values(params))}"

    def fingerprint(self, params: "EncodingParams", input_fingerprint: dict) -> dict:
        """What its cached arrays depend on."""
        # "graph encodings": the kind of the shortest-path entries written before there were others
        kind = "graph encodings" if self is PATHS else f"{self.name} encodings"
        return {"kind": kind, **self.values(params), "encoder_version": self.version(),
                "input": input_fingerprint}


def _shortest_paths(node_ptr, edge_index, edge_ptr, params, num_threads) -> dict[str, np.ndarray]:
    encoded = algos.encode_graphs(node_ptr, edge_index, edge_ptr, params.max_hops, num_threads=num_threads)
    arrays = {e.name: np.asarray(getattr(encoded, e.name), dtype=e.dtype).reshape(-1, *e.row_shape(params))
              for e in PATHS.encodings}
    arrays["pair_ptr"] = np.asarray(encoded.pair_ptr, dtype=np.int64)
    return arrays


def random_walk_return_probabilities(node_ptr: np.ndarray, edge_index: np.ndarray, edge_ptr: np.ndarray,
                                     steps: int) -> np.ndarray:
    r"""RWSE (GraphGPS, Rampášek et al. 2022): ``[sum n, steps]`` float32, node ``i``'s
    probability to be back at ``i`` after ``k`` steps of a uniform random walk, ``k = 1..steps``:

    .. math:: \mathrm{rwse}_{ik} = (P^k)_{ii}, \qquad P = D^{-1} A

    with ``A`` the adjacency (edge multiplicities counted) and ``D`` the out-degrees; a node
    without edges has ``P``'s row 0, so all its values are 0. Graphs of one size are stacked and
    multiplied together (float64), ``O(n^3 steps)`` each.
    """
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


#: Edges kept per shortest path (the multi-hop edge encoding's ``K``) when a run does not say:
#: the DataModules', the encoders' and the PyG transform's default. The recipes set their own
#: (``configs/zinc.yaml``: 20).
DEFAULT_MAX_HOPS = 5


@dataclass(frozen=True)
class EncodingParams:
    """Every encoding parameter; an encoder runs when all of its parameters are > 0.

    Attributes:
        max_hops: ``K``, edges kept per shortest path (Graphormer's multi-hop edge encoding).
        rwse_steps: random-walk steps of :data:`RWSE` (0: off).
    """

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
        return {enc.name: self.row_shape(enc)[0] for enc in self.encodings() if enc.embedded}

    def row_shape(self, encoding: Encoding) -> tuple[int, ...]:
        return encoding.row_shape(self)

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
        #: out-degree of each node
        Encoding("degree", "node", np.int16, np.int16, fill=0),
        #: shortest-path hop count, -1 = unreachable
        Encoding("spd", "pair", np.int16, np.int16, fill=UNREACHABLE),
        #: the first K edges along one shortest path, -1 where the path is shorter
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

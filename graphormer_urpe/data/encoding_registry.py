r"""The structural encodings stored per node or per node pair, as one registry.

Each :class:`Encoding` says how its values are stored (:class:`~.collate.FlatGraphs`, the
cache), how they are batched (:class:`~.batch.GraphBatch`) and what padding holds. Collation
(:func:`~.collate.collate`), the device gather (:func:`~.resident.gather_batch`), the cache
(:func:`~.cache.write_encodings`) and the batch's ``to`` / ``pin_memory`` loop over
:data:`ENCODINGS`; the encoder (:func:`graphormer_urpe.algos.encode_graphs`) computes them, one
attribute each of its result.

Storage, for a graph of ``n`` nodes stored from node row ``node_ptr[g]`` and pair row
``pair_ptr[g]`` (pair ``(i, j)`` at ``pair_ptr[g] + i n + j``):

.. math::
    \text{node encoding: } [\textstyle\sum_g n_g, *S], \qquad
    \text{pair encoding: } [\textstyle\sum_g n_g^2, *S], \qquad S = (K,) \text{ if per hop else } ()

and in a batch ``[B, N, *S]`` / ``[B, N, N, *S]``, ``fill`` at padded nodes and pairs. Values
that are LOCAL edge ids (``edge_ids``) become rows of the batch's ``edge_attr`` by adding the
number of edges of the graphs before it in the batch; ``-1`` (no edge) stays ``-1``.

Adding an encoding: compute it in the encoder (an attribute of its result, in the layout above),
add an :class:`Encoding` here, declare the field in ``GraphArrays`` (:mod:`.collate`) and in
:class:`~.batch.GraphBatch`, and embed it in the model.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from graphormer_urpe.algos import UNREACHABLE


@dataclass(frozen=True)
class Encoding:
    """One stored structural encoding.

    Attributes:
        name: the field of ``FlatGraphs``, ``GraphBatch`` and the encoder's result, and the cache
            array's name.
        per: ``"node"`` or ``"pair"``.
        dtype: stored dtype (``FlatGraphs``, cache).
        batch_dtype: dtype in ``GraphBatch``.
        fill: the value at padded nodes / pairs of a batch.
        per_hop: one column per hop (trailing size ``K = max_hops``).
        edge_ids: values are LOCAL edge ids (``-1`` = none), shifted to batch ``edge_attr`` rows.
    """

    name: str
    per: str
    dtype: type
    batch_dtype: type
    fill: int
    per_hop: bool = False
    edge_ids: bool = False

    def __post_init__(self) -> None:
        if self.per not in ("node", "pair"):
            raise ValueError(f"encoding {self.name!r}: per must be 'node' or 'pair', got {self.per!r}")

    def row_shape(self, max_hops: int) -> tuple[int, ...]:
        """Trailing shape of one node's / pair's values."""
        return (int(max_hops),) if self.per_hop else ()


ENCODINGS: tuple[Encoding, ...] = (
    #: out-degree of each node
    Encoding("degree", "node", np.int16, np.int16, fill=0),
    #: shortest-path hop count, -1 = unreachable
    Encoding("spd", "pair", np.int16, np.int16, fill=UNREACHABLE),
    #: the first K edges along one shortest path, -1 where the path is shorter
    Encoding("path_edges", "pair", np.int16, np.int32, fill=-1, per_hop=True, edge_ids=True),
)
NODE_ENCODINGS = tuple(e for e in ENCODINGS if e.per == "node")
PAIR_ENCODINGS = tuple(e for e in ENCODINGS if e.per == "pair")
#: Arrays of an encoding cache entry: every encoding plus the pair offsets.
ENCODING_ARRAYS: tuple[str, ...] = (*(e.name for e in ENCODINGS), "pair_ptr")


def stored_encodings(encoded, max_hops: int) -> dict[str, np.ndarray]:
    """Every :data:`ENCODING_ARRAYS` array of an encoder result
    (:class:`graphormer_urpe.algos.EncodedGraphs`), in its stored layout and dtype."""
    arrays = {e.name: np.asarray(getattr(encoded, e.name), dtype=e.dtype).reshape(-1, *e.row_shape(max_hops))
              for e in ENCODINGS}
    arrays["pair_ptr"] = np.asarray(encoded.pair_ptr, dtype=np.int64)
    return arrays

"""The padded batch that flows from collation into the model.

Shapes use ``B`` graphs, ``N`` = the largest node count in the batch (the graph token is NOT
included; the model prepends it), ``E`` = all edges of the batch, ``F``/``Fe`` = atom/bond feature
columns, ``K`` = ``max_hops``. Integer tensors are compact (int16/int32); the model widens them
where an index needs it.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch
from torch import Tensor


@dataclass
class GraphBatch:
    """A padded batch of encoded graphs.

    Attributes:
        x: ``[B, N, F]`` int32 atom feature ids, shifted by +1 per column so 0 is padding
            (column offsets are applied by the featurizer: one embedding table serves all columns).
        node_mask: ``[B, N]`` bool, True at real nodes.
        edge_attr: ``[E + 1, Fe]`` int32 bond feature ids, shifted by +1 (0 = padding); the last
            row is all zeros and is what ``path_edges == -1`` resolves to.
        y: ``[B, T]`` float32 targets (NaN where unknown, e.g. PCQM4Mv2 test sets).
        num_nodes: ``[B]`` int32 node counts.
        index: ``[B]`` int64 position of each graph in its dataset (for prediction order).
        encodings: the structural encodings by name (:mod:`.encodings`: layout, dtype,
            padding), each also readable as an attribute (``batch.spd``). Always:

            - ``degree [B, N]`` int16 node degrees (count of directed edges leaving the node);
            - ``spd [B, N, N]`` int16 shortest-path hop counts; ``-1`` = unreachable and padding;
            - ``path_edges [B, N, N, K]`` int32 rows of ``edge_attr`` along one shortest path
              from i to j (first ``K`` hops); ``-1`` where the path is shorter, for i == j and
              for padding;

            and those switched on by the data's parameters (``rwse [B, N, S]`` float32).
        descriptors: ``[B, D]`` float32 raw RDKit descriptors of each molecule (NaN where one
            fails), for a model that reads them beside its readout (``molecule_descriptors``);
            None otherwise.
    """

    x: Tensor
    node_mask: Tensor
    edge_attr: Tensor
    y: Tensor
    num_nodes: Tensor
    index: Tensor
    encodings: dict[str, Tensor]
    descriptors: Tensor | None = None

    def __getattr__(self, name: str) -> Tensor:
        encodings = self.__dict__.get("encodings")
        if encodings is not None and name in encodings:
            return encodings[name]
        raise AttributeError(f"{type(self).__name__} has no field or encoding {name!r}")

    def tensors(self) -> dict[str, Tensor]:
        """Every tensor by name, encodings included (flat: ``{"x": ..., "spd": ...}``)."""
        plain = {name: getattr(self, name) for name in _TENSOR_FIELDS}
        return {**{name: t for name, t in plain.items() if t is not None}, **self.encodings}

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor]) -> "GraphBatch":
        """The inverse of :meth:`tensors`."""
        return cls(**{k: v for k, v in tensors.items() if k in _TENSOR_FIELDS},
                   encodings={k: v for k, v in tensors.items() if k not in _TENSOR_FIELDS})

    def map(self, fn) -> "GraphBatch":
        """Every tensor replaced by ``fn(tensor)``."""
        return self.from_tensors({name: fn(t) for name, t in self.tensors().items()})

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "GraphBatch":
        return self.map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "GraphBatch":
        return self.map(lambda t: t.pin_memory())

    def alone(self, g: int, times: int = 1) -> "GraphBatch":
        """Graph ``g`` as a batch of its own, ``times`` copies of it: ``N`` its node count (no
        padding of the others), ``edge_attr`` its own edge rows (numbered from 0, then the zero
        row), so the same graph gives the same batch whatever batch it came from (the batch
        :func:`~.collate.collate` makes of it alone, copies sharing its edge rows)."""
        from graphormer_urpe.data.encodings import ENCODING_BY_NAME

        n = int(self.num_nodes[g])
        rows = torch.arange(g, g + 1, device=self.x.device).repeat(times)
        encodings, edge_rows = {}, self.edge_attr[:0]
        for name, values in self.encodings.items():
            spec = ENCODING_BY_NAME[name]
            values = values[rows, :n, :n] if spec.per == "pair" else values[rows, :n]
            if spec.edge_ids:  # this graph's rows are one block of the batch's edge_attr
                present = values[values >= 0]
                first = int(present.min()) if present.numel() else 0
                edge_rows = self.edge_attr[first:int(present.max()) + 1] if present.numel() else edge_rows
                values = torch.where(values >= 0, values - first, values)
            encodings[name] = values
        return GraphBatch(x=self.x[rows, :n], node_mask=self.node_mask[rows, :n],
                          edge_attr=torch.cat([edge_rows, torch.zeros_like(self.edge_attr[-1:])]),
                          y=self.y[rows], num_nodes=self.num_nodes[rows], index=self.index[rows],
                          encodings=encodings,
                          descriptors=None if self.descriptors is None else self.descriptors[rows])

    @property
    def num_graphs(self) -> int:
        return self.x.shape[0]

    def __len__(self) -> int:
        return self.num_graphs


#: GraphBatch's tensor fields (all but ``encodings``), in order; a constant, which
#: ``torch.compile`` reads where it cannot trace ``dataclasses.fields``.
_TENSOR_FIELDS = tuple(f.name for f in fields(GraphBatch) if f.name != "encodings")


@dataclass(frozen=True)
class BatchPadding:
    """Fixed batch sizes for shape-stable training steps (CUDA graphs, static compilation).

    Every batch is padded to ``N = num_nodes`` nodes per graph and ``E = num_edges`` edge rows
    (``edge_attr`` then has ``E + 1`` rows). Padding is what :class:`GraphBatch` already uses for
    graphs smaller than the batch's largest: masked nodes (``node_mask`` False, id 0), pairs
    with ``spd = -1`` and no path edges, and all-zero ``edge_attr`` rows that no path points to;
    so the padded batch gives the same loss and gradients as the unpadded one.
    """

    num_nodes: int
    num_edges: int

    @classmethod
    def covering(cls, num_nodes: np.ndarray, num_edges: np.ndarray, batch_size: int) -> "BatchPadding":
        """The smallest padding that fits any ``batch_size`` of the given graphs (node counts
        ``[G]``, edge counts ``[G]``): the largest node count, and the sum of the
        ``batch_size`` largest edge counts."""
        if len(num_nodes) == 0:
            raise ValueError("cannot size a padding for an empty split")
        edges = np.sort(np.asarray(num_edges, dtype=np.int64))[::-1][:batch_size]
        return cls(int(np.max(num_nodes)), int(edges.sum()))

    def check(self, max_nodes: int, total_edges: int, num_graphs: int = 0) -> None:
        """ValueError unless a batch of ``num_graphs`` graphs, ``max_nodes`` (N) and
        ``total_edges`` (E) fits."""
        if max_nodes > self.num_nodes or total_edges > self.num_edges:
            raise ValueError(f"a batch of {num_graphs} graphs with N={max_nodes} nodes per graph and "
                             f"E={total_edges} edges does not fit the padding N={self.num_nodes}, "
                             f"E={self.num_edges}")

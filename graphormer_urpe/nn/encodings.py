r"""Graphormer's structural encodings (Ying et al., 2021), one module per concept, plus URPE's C.

Node side (added to the token embeddings, ``[B, N, D]``):

* :class:`AtomEncoder` — ``h_i = sum_c E_atom[x_ic]`` over the atom feature columns.
* :class:`DegreeEncoder` — centrality encoding ``z[deg(i)]``.
* :class:`GraphToken` — a learnable token prepended at index 0 that reads the graph out.

Pair side (per head, ``[B, H, N+1, N+1]``, graph token at index 0):

* :class:`SpatialBias` — ``b_{phi(i,j)}``, a learnable scalar per head per shortest-path distance.
* :class:`VirtualDistanceBias` — one learnable ``t`` per head on the graph token's row and column.
* :class:`EdgePathBias` — Graphormer's multi-hop edge encoding along one shortest path.
* :class:`URPEScale` — URPE's ``C_{psi(i,j)}``, a learnable per-head table initialised to 1.

Distance slots (:func:`distance_slots`, the one place this convention lives): a real pair with
shortest-path distance ``d >= 0`` uses slot ``min(d, max_spd)``; an unreachable pair (``spd = -1``)
uses slot ``max_spd + 1``; C additionally has slot ``max_spd + 2`` for every pair that involves
the graph token. Padded pairs also carry ``spd = -1``; their values are never seen, because the
attention masks padded keys and padded query rows are never read out.

Initialisation follows Graphormer v1: embeddings ``N(0, 0.02)`` with padding rows kept at zero,
C exactly one (so a fresh URPE model computes exactly what plain RPE attention computes);
C is stored as ``C - 1`` so that weight decay pulls it toward 1 (see :class:`URPEScale`).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

EMBEDDING_STD = 0.02  # Graphormer's init for every embedding table
#: Zero rows that absent (pair, hop) slots read in :meth:`EdgePathBias.sum_hops_gather`;
#: enough that no row collects more than a few hundred slots of a ZINC batch of 256 at 20 hops.
ABSENT_ROWS = 1 << 14


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def distance_slots(spd: Tensor, max_spd: int) -> Tensor:
    """Table slots of node pairs: ``min(d, max_spd)`` for distance ``d``, ``max_spd + 1`` where
    ``spd == -1`` (unreachable or padding).

    Args:
        spd: ``[B, N, N]`` int16 shortest-path hops, ``-1`` = unreachable / padding.
    Returns:
        ``[B, N, N]`` int32 slots in ``[0, max_spd + 1]``.
    """
    spd = spd.to(torch.int32)
    return torch.where(spd < 0, max_spd + 1, spd.clamp(max=max_spd))


class AtomEncoder(nn.Module):
    r"""Atom embedding summed over feature columns: ``h_i = \sum_c E[x_{ic}]``.

    All columns share one table (the featurizer offsets each column's ids, id 0 = padding), so a
    padded node embeds to zero.

    Shapes: x ``[B, N, F]`` int ids -> ``[B, N, D]``.
    """

    def __init__(self, num_atom_embeddings: int, hidden_dim: int) -> None:
        super().__init__()
        _check_positive(num_atom_embeddings=num_atom_embeddings, hidden_dim=hidden_dim)
        self.embedding = nn.Embedding(num_atom_embeddings, hidden_dim, padding_idx=0)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.embedding.weight, std=EMBEDDING_STD)
        with torch.no_grad():
            self.embedding.weight[0].zero_()

    def forward(self, x: Tensor) -> Tensor:
        return self.embedding(x).sum(dim=-2)


class DegreeEncoder(nn.Module):
    r"""Centrality encoding ``z[\min(\deg(i), \text{max\_degree})]`` (Graphormer eq. 5).

    Slot 0 is padding; degree ``k`` uses slot ``min(k, max_degree) + 1``, so the table has
    ``max_degree + 2`` rows (Graphormer's ZINC table: 64 rows, ``max_degree = 62``). Graphormer
    keeps separate in- and out-degree tables; on undirected molecules both are indexed by the
    same degree, so their sum is one table and this module keeps only one.

    Shapes: degree ``[B, N]`` int, node_mask ``[B, N]`` bool -> ``[B, N, D]``.
    """

    def __init__(self, max_degree: int, hidden_dim: int) -> None:
        super().__init__()
        _check_positive(max_degree=max_degree, hidden_dim=hidden_dim)
        self.max_degree = max_degree
        self.embedding = nn.Embedding(max_degree + 2, hidden_dim, padding_idx=0)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.embedding.weight, std=EMBEDDING_STD)
        with torch.no_grad():
            self.embedding.weight[0].zero_()

    def forward(self, degree: Tensor, node_mask: Tensor) -> Tensor:
        slot = degree.to(torch.int32).clamp(0, self.max_degree) + 1
        return self.embedding(torch.where(node_mask, slot, 0))


class GraphToken(nn.Module):
    """A learnable virtual node prepended at index 0; the model reads the graph out from it.

    Shapes: node embeddings ``[B, N, D]`` -> ``[B, N+1, D]``.
    """

    #: AdamW param group (``training.optim.parameter_kind``).
    weight_decay_kind = "embedding"

    def __init__(self, hidden_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=EMBEDDING_STD)

    def forward(self, nodes: Tensor) -> Tensor:
        token = self.weight.to(nodes.dtype).expand(nodes.shape[0], 1, -1)
        return torch.cat([token, nodes], dim=1)


class SpatialBias(nn.Module):
    r"""Spatial encoding: ``B_{h,ij} \mathrel{+}= b_h[\phi(i, j)]`` with ``\phi`` the shortest-path
    distance (Graphormer eq. 6), one learnable scalar per head and distance slot.

    The table has ``max_spd + 2`` rows: distances ``0 .. max_spd`` (longer ones share the last)
    and "unreachable" (see :func:`distance_slots`).

    Shapes: slots ``[B, N, N]`` -> ``[B, H, N, N]``.
    """

    def __init__(self, max_spd: int, num_heads: int) -> None:
        super().__init__()
        _check_positive(max_spd=max_spd, num_heads=num_heads)
        self.embedding = nn.Embedding(max_spd + 2, num_heads)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.embedding.weight, std=EMBEDDING_STD)

    def forward(self, slots: Tensor) -> Tensor:
        return self.embedding(slots).permute(0, 3, 1, 2)


class VirtualDistanceBias(nn.Module):
    r"""Graph-token virtual distance: one learnable ``t_h`` per head added to the graph token's
    row (it attending to everything) and column (every node attending to it); ``[0, 0]`` gets it
    once, as in Graphormer.

    Shapes: node-pair bias ``[B, H, N, N]`` -> ``[B, H, N+1, N+1]``.
    """

    #: AdamW param group (``training.optim.parameter_kind``).
    weight_decay_kind = "embedding"

    def __init__(self, num_heads: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_heads))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=EMBEDDING_STD)

    def forward(self, node_bias: Tensor) -> Tensor:
        n1 = node_bias.shape[-1] + 1
        on_token = torch.zeros(n1, n1, dtype=node_bias.dtype, device=node_bias.device)
        on_token[0, :] = 1
        on_token[:, 0] = 1
        return F.pad(node_bias, (1, 0, 1, 0)) + self.weight.view(1, -1, 1, 1) * on_token


class EdgePathBias(nn.Module):
    r"""Graphormer's multi-hop edge encoding (eq. 7, ``edge_type = "multi_hop"``).

    For a pair ``(i, j)`` with shortest path ``e_1, ..., e_n`` (only the first ``K`` hops are kept):

    .. math::
        c_{h,ij} = \frac{1}{\min(n, K)} \sum_{k=1}^{\min(n, K)} \big(w(e_k)\, W_k\big)_h,
        \qquad w(e) = \frac{1}{F_e} \sum_c E_{\text{bond}}[\text{edge\_attr}_{e c}] \in \mathbb{R}^H,

    with ``W_k`` a learnable ``[H, H]`` matrix per hop (Graphormer's ``edge_dis_encoder``). Hops
    that are absent (``path_edges = -1``: shorter paths, ``i = j``, unreachable, padding)
    contribute nothing and are not counted, so the sum is a mean over the hops actually present.
    (Graphormer also divides by the hop count, but its padded hops index a padding row that its
    init leaves non-zero; here they are masked out.)

    ``path_edges`` must hold exactly ``K = max_hops`` hops (else a ValueError: data encoded with
    other parameters than the model's). The per-hop tables ``w W_k`` are built once per
    batch (``[K, E+1, H]``) and summed along each path with :func:`F.embedding_bag`, so no
    ``[B, N, N, K, H]`` tensor is materialised. Under ``torch.compile`` the sum is a plain gather
    and reduction instead (:meth:`sum_hops_gather`), which inductor fuses into one kernel (again
    nothing of size ``[B, N, N, K, H]``) and whose backward (embedding's) CUDA graphs can
    capture: ``embedding_bag``'s CUDA backward reads a count back to the host (so the training
    engine and the ensemble set :attr:`gather_hops`, which forces the gather). On a CPU (eager,
    without gather_hops) only the hops present are gathered and summed (:meth:`sum_hops_packed`): most
    (pair, hop) slots are absent at 20 hops, and ``embedding_bag``'s backward (a sort of all
    ``B N N K`` indices) took twice as long as even the full gather's scatter-add.

    Shapes: edge_attr ``[E+1, Fe]`` int ids, path_edges ``[B, N, N, K]`` int rows of edge_attr
    (``-1`` = none) -> ``[B, H, N, N]``.
    """

    def __init__(self, num_bond_embeddings: int, num_heads: int, max_hops: int) -> None:
        super().__init__()
        _check_positive(num_bond_embeddings=num_bond_embeddings, num_heads=num_heads,
                        max_hops=max_hops)
        self.max_hops = max_hops
        self.embedding = nn.Embedding(num_bond_embeddings, num_heads, padding_idx=0)
        self.hop_weight = nn.Parameter(torch.empty(max_hops, num_heads, num_heads))
        #: Sum hops with the gather on every device (set by Graphormer.make_capture_safe: a CUDA
        #: graph cannot hold embedding_bag's host read-back nor the CPU's packed sum); not saved.
        self.gather_hops = False
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.embedding.weight, std=EMBEDDING_STD)
        nn.init.normal_(self.hop_weight, std=EMBEDDING_STD)
        with torch.no_grad():
            self.embedding.weight[0].zero_()

    def forward(self, edge_attr: Tensor, path_edges: Tensor) -> Tensor:
        batch, n, _, k = path_edges.shape
        if k != self.max_hops:
            raise ValueError(f"path_edges hold {k} hops but the edge encoding has max_hops={self.max_hops}")
        num_rows = edge_attr.shape[0]  # E + 1
        edge_values = self.embedding(edge_attr).mean(dim=-2)  # [E+1, H]
        hop_tables = torch.einsum("eh,khg->keg", edge_values, self.hop_weight)  # [K, E+1, H]
        hops = path_edges.reshape(-1, k)
        present = hops >= 0
        table = hop_tables.reshape(k * num_rows, -1)
        compiling = torch.compiler.is_compiling()
        if hop_tables.device.type == "cpu" and not compiling and not self.gather_hops:
            summed = self.sum_hops_packed(table, hops, present, num_rows)
        else:
            # Row of hop k's table for each path edge; absent hops point anywhere valid, weight 0.
            index = torch.where(present, hops, 0) + torch.arange(k, device=hops.device,
                                                                  dtype=hops.dtype) * num_rows
            if self.gather_hops or compiling:
                summed = self.sum_hops_gather(table, index, present)
            else:
                summed = self.sum_hops_bag(table, index, present.to(hop_tables.dtype))
        count = present.sum(dim=-1, keepdim=True).clamp_min(1)
        return (summed / count).view(batch, n, n, -1).permute(0, 3, 1, 2)

    @staticmethod
    def sum_hops_bag(table: Tensor, index: Tensor, weights: Tensor) -> Tensor:
        """``sum_k weights[p, k] * table[index[p, k]]``: table ``[R, H]``, index and weights
        ``[P, K]`` -> ``[P, H]``, with ``embedding_bag`` (eager: no ``[P, K, H]`` tensor)."""
        return F.embedding_bag(index, table, mode="sum", per_sample_weights=weights)

    @staticmethod
    def sum_hops_packed(table: Tensor, hops: Tensor, present: Tensor, num_rows: int) -> Tensor:
        """``sum_k table[k * num_rows + hops[p, k]]`` over the hops present (``hops >= 0``):
        table ``[K * R, H]``, hops and present ``[P, K]`` -> ``[P, H]``. Only the present
        (pair, hop) slots are gathered and added up (64 ZINC-12k test graphs at 20 hops: 13 %), so
        neither the forward nor its scatter-add backward touches the absent ones. The number of
        slots is read from the data (``nonzero``): CPU eager only, never compiled or on a GPU."""
        k = hops.shape[1]
        slot = present.reshape(-1).nonzero().squeeze(1)  # flat (pair, hop) positions
        pair, hop = slot.div(k, rounding_mode="floor"), slot.remainder(k)
        rows = hops.reshape(-1)[slot].to(slot.dtype) + hop * num_rows
        summed = table.new_zeros(hops.shape[0], table.shape[1])
        return summed.index_add(0, pair, table.index_select(0, rows))

    @staticmethod
    def sum_hops_gather(table: Tensor, index: Tensor, present: Tensor) -> Tensor:
        """``sum_k table[index[p, k]]`` over the hops present: table ``[R, H]``, index and
        present ``[P, K]`` -> ``[P, H]``, as a gather and a reduction (fused under
        ``torch.compile``) with no data-dependent size. Absent hops read one of
        :data:`ABSENT_ROWS` appended zero rows (slot number modulo their count), whose gradient
        the padding drops. Most slots are absent at 20 hops, and CUDA's embedding backward sums
        each row's duplicates in one thread per feature: one shared absent row (``padding_idx``)
        made that a loop over ~6 million slots, 57 of the 79 ms of a slim step at batch 256 on
        one H200; spread over many rows the sums run side by side."""
        pad = table.shape[0]
        slot = torch.arange(index.numel(), device=index.device, dtype=index.dtype).view_as(index)
        rows = torch.where(present, index, pad + slot.remainder(ABSENT_ROWS))
        return F.embedding(rows, F.pad(table, (0, 0, 0, ABSENT_ROWS))).sum(dim=1)


class URPEScale(nn.Module):
    r"""URPE's learnable scale ``C_{h,ij} = c_h[\psi(i, j)]`` (Luo et al., 2022, eq. 8), applied
    after the softmax: ``(softmax(QK^T / \sqrt{d} + B) \odot C) V``.

    One entry per head for each distance ``0 .. max_spd`` (longer ones share the last), one for
    "unreachable" and one for every pair involving the graph token (see :func:`distance_slots`):
    ``max_spd + 3`` rows.

    Parametrised as ``C = 1 + delta`` with ``delta`` initialised to 0: C starts at 1, where URPE
    attention equals RPE attention exactly, and weight decay (which pulls a parameter toward 0)
    pulls C toward its neutral value 1 instead of toward 0, which would scale attention down.
    This matters for slots the training data never reaches (distances above the training
    maximum): their gradient is zero, so decay alone moves them. ``delta`` is a plain parameter
    rather than ``nn.Embedding``, so generic embedding initialisers leave it alone.

    Shapes: slots ``[B, N+1, N+1]`` (from :meth:`slots`) -> ``[B, H, N+1, N+1]``.
    """

    #: AdamW param group (``training.optim.parameter_kind``).
    weight_decay_kind = "urpe_scale"

    def __init__(self, max_spd: int, num_heads: int) -> None:
        super().__init__()
        _check_positive(max_spd=max_spd, num_heads=num_heads)
        self.max_spd = max_spd
        self.delta = nn.Parameter(torch.empty(max_spd + 3, num_heads))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.delta)

    def table(self) -> Tensor:
        """The effective C, ``[max_spd + 3, H]`` (row = slot)."""
        return 1.0 + self.delta

    @staticmethod
    def slots(node_slots: Tensor, max_spd: int) -> Tensor:
        """Extend node-pair slots ``[B, N, N]`` to ``[B, N+1, N+1]`` with the graph-token slot
        ``max_spd + 2`` on row 0 and column 0."""
        return F.pad(node_slots, (1, 0, 1, 0), value=max_spd + 2)

    def forward(self, slots: Tensor) -> Tensor:
        return F.embedding(slots, self.table()).permute(0, 3, 1, 2)

    @staticmethod
    def lookup_many(scales: Sequence["URPEScale"], slots: Tensor) -> list[Tensor]:
        """``[scale(slots) for scale in scales]`` as ONE lookup of the concatenated tables: the
        slots are the same for every layer, and an embedding's backward costs per index, so one
        ``L * H``-wide lookup is much cheaper than ``L`` narrow ones (slim on CPU: the 12
        separate backwards took ~20 ms of a ~175 ms step). Values are identical (a gather)."""
        table = 1.0 + torch.cat([scale.delta for scale in scales], dim=1).t()  # [L * H, S]
        b, n, m = slots.shape
        # Gathering along the table's last dim gives [L * H, B, N+1, N+1] with contiguous
        # [N+1, N+1] blocks, so the products with the probabilities need no layout copies.
        gathered = table.index_select(1, slots.reshape(-1)).view(len(scales), -1, b, n, m)
        return list(gathered.transpose(1, 2).unbind(0))

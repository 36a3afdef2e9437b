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
#: :meth:`EdgePathBias.sum_hops_counted` serves bond vocabularies of up to this many ids (or the
#: head count, if larger): ZINC has 4, OGB's features 13. Its counts ``[P, K, ids]`` are then no
#: larger than a few gathered ``[P, K, H]`` rows; larger vocabularies take the gather.
COUNTED_MAX_BOND_IDS = 16
#: :func:`lookup_by_product` serves distance tables of up to this many rows (slim: 40 and 41),
#: :func:`embed_by_product` node tables (ZINC's 29 atom ids, slim's 64 degree slots). The one-hot
#: matrices and products grow with the rows: presets with ``max_spd = 510`` (small, base) and
#: OGB's offset atom columns look up instead, on every device.
PRODUCT_MAX_SLOTS = 64


def static_form(flag: bool, tensor: Tensor) -> bool:
    """Whether a pair encoding computes in the form a CUDA graph holds and a GPU runs fast (fixed
    shapes, no host reads, products with one-hot slot matrices instead of scatter-adds): when its
    ``static_shapes`` is set (:meth:`Graphormer.use_static_shapes`), off a CPU, or under
    ``torch.compile``. The CPU's eager form is the gather and scatter-add, which a CPU runs faster."""
    return flag or tensor.device.type != "cpu" or torch.compiler.is_compiling()


def lookup_per_head(table: Tensor, slots: Tensor) -> Tensor:
    """``table[slots]`` with the heads second: ``[S, H]`` table, slots ``[B, N, M]`` ->
    ``[B, H, N, M]`` (contiguous), gathered from the table broadcast over the graphs. Its
    backward adds into a small ``[B, H, S]`` buffer and sums that over the graphs: on a CPU
    several times faster than an embedding lookup (a sort) or an ``index_select`` along the
    table's columns (whose ``index_add`` backward runs serially), and no layout copy."""
    b, n, m = slots.shape
    num_slots, heads = table.shape
    index = slots.long().reshape(b, 1, n * m).expand(b, heads, n * m)
    looked_up = table.t().reshape(1, heads, num_slots).expand(b, heads, num_slots).gather(2, index)
    return looked_up.view(b, heads, n, m)


def lookup_by_product(table: Tensor, slots: Tensor, offset: float = 0.0) -> Tensor:
    """``table[slots] + offset`` with the table's columns second: ``[S, C]`` table, integer slots
    ``[B, *rest]`` -> ``[B, C, *rest]`` (contiguous), as one product per graph
    ``table^T onehot(slots_b)`` (a batched matrix product); its backward is one too.

    Why: a CUDA lookup's backward adds each slot's gradients with atomics (``index_add``) or one
    thread per feature (embedding's), both serial over the ~10,000 pairs that share a distance slot
    in a batch of 256 ZINC graphs, a large part of a slim step on a GPU (docs/benchmarks.md).
    Matrix products are exact for the one-hot factor; the table rounds as any
    float32 matrix product does under ``torch.set_float32_matmul_precision`` (autocast stays off),
    which is why ``offset`` is added after the product (URPE's C is ``1 + delta``: a TF32 product
    then rounds delta, not C near 1). The graphs stay first, so the attention reads each graph's
    ``[C, *rest]`` block in one piece and the gradients arrive in the product's own layout (no copy).
    The offset is added in place to the product itself, not to a view of it, which autograd
    would otherwise answer with whole-tensor copies in the backward."""
    dtype = torch.promote_types(table.dtype, torch.float32)
    batch, (num_slots, columns) = slots.shape[0], table.shape
    flat = slots.reshape(batch, 1, -1)
    onehot = flat == torch.arange(num_slots, device=slots.device, dtype=slots.dtype)[:, None]  # [B, S, R]
    with torch.autocast(slots.device.type, enabled=False):
        # bmm, not matmul: matmul would fold the batch into one product and transpose its result.
        product = torch.bmm(table.t().to(dtype).expand(batch, columns, num_slots), onehot.to(dtype))
    if offset:
        product.add_(offset)
    return product.to(table.dtype).view(batch, columns, *slots.shape[1:])


def id_counts(ids: Tensor, num_ids: int, dim: int) -> Tensor:
    """How often each id ``1 .. num_ids - 1`` occurs along ``dim`` of ``ids`` (id 0, padding or
    absent, counts nothing): float32, ``dim`` removed and the ids as a new last axis."""
    vocab = torch.arange(1, num_ids, device=ids.device, dtype=ids.dtype)
    return (ids[..., None] == vocab).sum(dim if dim >= 0 else dim - 1, dtype=torch.float32)


def embed_by_product(table: Tensor, ids: Tensor) -> Tensor:
    """``sum_c table[ids[..., c]]`` over the id columns, id 0 (padding) adding nothing: ``[V, D]``
    table, ids ``[*, F]`` -> ``[*, D]``, as each row's counts of ids ``1 .. V-1`` times
    ``table[1:]``, one matrix product (float32, autocast off); row 0 gets no gradient, as under
    ``padding_idx=0``. Why: a CUDA embedding's backward over a batch's ~10,000 nodes sorts their
    ids and sums segments, a dozen small kernels; the product's backward is one."""
    dtype = torch.promote_types(table.dtype, torch.float32)
    counts = id_counts(ids, table.shape[0], dim=-1).to(dtype)  # [*, V-1]
    with torch.autocast(ids.device.type, enabled=False):
        return (counts @ table[1:].to(dtype)).to(table.dtype)


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
        #: Embed by product on every device (:func:`static_form`); not saved.
        self.static_shapes = False
        #: Small enough a vocabulary for :func:`embed_by_product` (ZINC: 29 ids; OGB's offset
        #: columns: thousands, which gather).
        self.by_product = num_atom_embeddings <= PRODUCT_MAX_SLOTS
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.embedding.weight, std=EMBEDDING_STD)
        with torch.no_grad():
            self.embedding.weight[0].zero_()

    def forward(self, x: Tensor) -> Tensor:
        if self.by_product and static_form(self.static_shapes, x):
            return embed_by_product(self.embedding.weight, x)
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
        #: Embed by product on every device (:func:`static_form`); not saved.
        self.static_shapes = False
        #: Small enough a table for :func:`embed_by_product` (slim: 64 rows; small, base: 512).
        self.by_product = max_degree + 2 <= PRODUCT_MAX_SLOTS
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.embedding.weight, std=EMBEDDING_STD)
        with torch.no_grad():
            self.embedding.weight[0].zero_()

    def forward(self, degree: Tensor, node_mask: Tensor) -> Tensor:
        slot = torch.where(node_mask, degree.to(torch.int32).clamp(0, self.max_degree) + 1, 0)
        if self.by_product and static_form(self.static_shapes, slot):
            return embed_by_product(self.embedding.weight, slot[..., None])
        return self.embedding(slot)


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
        #: Look up by product on every device (:func:`static_form`); not saved.
        self.static_shapes = False
        #: Small enough a table for :func:`lookup_by_product`.
        self.by_product = max_spd + 2 <= PRODUCT_MAX_SLOTS
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.embedding.weight, std=EMBEDDING_STD)

    def forward(self, slots: Tensor) -> Tensor:
        if self.by_product and static_form(self.static_shapes, slots):
            return lookup_by_product(self.embedding.weight, slots)
        return lookup_per_head(self.embedding.weight, slots)


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
    other parameters than the model's). No ``[B, N, N, K, H]`` tensor is materialised; the hops
    are summed in one of three forms, equal up to float rounding:

    * CPU eager (:meth:`sum_hops_packed`): only the hops present are gathered and added up. Most
      (pair, hop) slots are absent at 20 hops; the number present is read from the data.
    * The static form (:func:`static_form`: GPUs, ``torch.compile``, the training step on
      batches of one shape), for bond vocabularies of up to :data:`COUNTED_MAX_BOND_IDS` ids
      (:meth:`sum_hops_counted`): each pair's counts of (hop, bond id) times the per-hop tables
      ``E_bond W_k``, one matrix product each way, with fixed shapes.
    * The static form for larger vocabularies (:meth:`sum_hops_gather`): every (pair, hop) slot
      gathered from the per-hop tables of the batch's edges ``w(e) W_k`` and summed.

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
        #: Sum hops in the static form on every device (:func:`static_form`; set by
        #: Graphormer.use_static_shapes: a CUDA graph cannot hold the packed sum's data-dependent
        #: size); not saved.
        self.static_shapes = False
        #: The static form counts (hop, bond id) pairs (:meth:`sum_hops_counted`) rather than
        #: gathering every (pair, hop) slot.
        self.counts_bonds = num_bond_embeddings - 1 <= max(num_heads, COUNTED_MAX_BOND_IDS)
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
        hops = path_edges.reshape(-1, k)
        present = hops >= 0
        if not static_form(self.static_shapes, hops):
            summed = self.sum_hops_packed(self.edge_hop_tables(edge_attr), hops, present, edge_attr.shape[0])
        elif self.counts_bonds:
            summed = self.sum_hops_counted(self.bond_counts(edge_attr, hops, present),
                                           self.bond_hop_tables(edge_attr.shape[1]))
        else:
            # Row of hop k's table for each path edge; absent hops point anywhere valid, weight 0.
            index = torch.where(present, hops, 0) + torch.arange(k, device=hops.device,
                                                                  dtype=hops.dtype) * edge_attr.shape[0]
            summed = self.sum_hops_gather(self.edge_hop_tables(edge_attr), index, present)
        count = present.sum(dim=-1, keepdim=True).clamp_min(1)
        return (summed / count).view(batch, n, n, -1).permute(0, 3, 1, 2)

    def edge_hop_tables(self, edge_attr: Tensor) -> Tensor:
        """``w(e) W_k`` for every edge row of the batch and hop, ``[K * (E+1), H]`` (row
        ``k * (E+1) + e``), with ``w(e)`` the mean of the edge's bond embeddings."""
        edge_values = self.embedding(edge_attr).mean(dim=-2)  # [E+1, H]
        return torch.einsum("eh,khg->keg", edge_values, self.hop_weight).flatten(0, 1)

    def bond_hop_tables(self, num_columns: int) -> Tensor:
        """``E_bond[v] W_k / Fe`` for every hop and bond id ``v >= 1`` (0 is padding),
        ``[K, ids, H]``: an edge's mean over its ``Fe`` columns is the sum of its ids' rows."""
        return torch.einsum("vh,khg->kvg", self.embedding.weight[1:], self.hop_weight) / num_columns

    def bond_counts(self, edge_attr: Tensor, hops: Tensor, present: Tensor) -> Tensor:
        """How often each bond id occurs among the columns of each (pair, hop)'s edge: ``[P, K, ids]``
        float32 (absent hops count nothing). Ids are read one element at a time (the transposed
        ``edge_attr``), which CUDA gathers in parallel where a row gather runs a block per row."""
        ids = edge_attr.t().index_select(1, torch.where(present, hops, 0).reshape(-1))
        ids = ids.view(edge_attr.shape[1], *hops.shape) * present  # [Fe, P, K]; absent: id 0
        return id_counts(ids, self.embedding.num_embeddings, dim=0)

    @staticmethod
    def sum_hops_counted(counts: Tensor, tables: Tensor) -> Tensor:
        """``sum_{k, v} counts[p, k, v] * tables[k, v]``: counts ``[P, K, ids]``, tables
        ``[K, ids, H]`` -> ``[P, H]``, one matrix product (its backward to the tables is another),
        float32 with autocast off. On a GPU a gather would write ``[P, K, H]`` with a thread block
        per gathered row (of a slim step's row gathers, this one gathers by far the most rows) and
        add its gradient back through a sort of all ``P K`` slots."""
        dtype = torch.promote_types(tables.dtype, torch.float32)
        with torch.autocast(counts.device.type, enabled=False):
            return counts.flatten(1).to(dtype) @ tables.flatten(0, 1).to(dtype)

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
        would make that a loop over millions of slots; spread over many rows the sums run side by
        side."""
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
        #: :meth:`lookup_many` by product on every device (:func:`static_form`); not saved.
        self.static_shapes = False
        #: Small enough a table for :func:`lookup_by_product`.
        self.by_product = max_spd + 3 <= PRODUCT_MAX_SLOTS
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
        return lookup_per_head(self.table(), slots)

    @staticmethod
    def lookup_many(scales: Sequence["URPEScale"], slots: Tensor) -> list[Tensor]:
        """``[scale(slots) for scale in scales]`` in the static form: one batched product of the
        concatenated tables with the slots' one-hot matrices (:func:`lookup_by_product`), whose
        backward is one too. The 1 of ``C = 1 + delta`` is added after the product, so a
        float32 product gives the gathered C bit for bit, and a TF32 one (matmul precision
        ``high``) rounds delta, not C near 1."""
        delta = torch.cat([scale.delta for scale in scales], dim=1)  # [S, L * H]
        # [B, L * H, N+1, N+1]: each layer's C is a [B, H, N+1, N+1] slice whose [H, N+1, N+1]
        # block per graph is contiguous, and the concatenated gradients arrive in this layout.
        looked_up = lookup_by_product(delta, slots, offset=1.0)
        return list(looked_up.unflatten(1, (len(scales), -1)).unbind(1))

r"""The Graphormer backbone (Ying et al., 2021) with URPE attention (Luo et al., 2022).

.. math::
    h^{(0)} &= [\,g;\ E_{atom}(x) + z(\deg) + \textstyle\sum_s W_s r_s\,] \in \mathbb{R}^{(N+1) \times D}
    \qquad \text{(graph token } g \text{ at index 0)} \\
    a^{(l)} &= h^{(l-1)} + \mathrm{Attn}\big(\mathrm{LN}(h^{(l-1)});\ B,\ C^{(l)}\big), \qquad
    h^{(l)} = a^{(l)} + \mathrm{FFN}\big(\mathrm{LN}(a^{(l)})\big) \\
    \hat y &= W\, \mathrm{readout}\big(\mathrm{LN}(h^{(L)})\big) + b

with ``r_s`` the data's optional per-node encodings (``node_encodings``, e.g. RWSE) and ``W_s`` a
linear map each, ``Attn`` = :class:`~graphormer_urpe.nn.attention.URPEAttention`,
``B = spatial(SPD) + edge path + graph-token virtual distance`` (shared by all layers, as in
Graphormer) and ``C^{(l)}`` the URPE scale table indexed by SPD (one per layer, or one shared by
all layers with ``share_urpe_scale``). ``attention`` selects the variant (:data:`ATTENTION_VARIANTS`):
``"urpe"`` (B and C), ``"rpe"`` (B only: plain Graphormer) or ``"none"`` (neither: a plain
transformer over atoms).

``readout`` (:data:`READOUTS`) is what the head reads of ``LN(h^{(L)})``: ``"token"``, the graph
token's vector (Graphormer's); ``"sum"``, the sum of the atoms' vectors (chemprop's default
aggregation, PyG's ``global_add_pool``), which grows with the number of atoms as an additive
property does; ``"token+sum"``, both side by side (``2D`` wide). The token alone is a
softmax-weighted mean of node states, so a property that grows with the number of groups must
be recovered from averages.

With the data's ``num_descriptors`` > 0 (``molecule_descriptors``), the head reads
``[readout; GELU(W_d s)]``, ``s`` the molecule's RDKit descriptors clipped and standardized with
the training split's statistics, which the head keeps (:class:`DescriptorHead`).

Defaults are Graphormer-slim on ZINC (``PRESETS["slim"]``, a :class:`GraphormerConfig`); see
``docs/model.md`` for where every
value and every parameter-count difference to the papers comes from.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor, nn

from graphormer_urpe.data.batch import GraphBatch
from graphormer_urpe.data.descriptors import standardize
from graphormer_urpe.data.encodings import CORE_ENCODINGS
from graphormer_urpe.data.facts import DataFacts
from graphormer_urpe.nn.attention import URPEAttention, attention_kernel
from graphormer_urpe.nn.dropout import Dropout
from graphormer_urpe.nn.encodings import (
    AtomEncoder,
    DegreeEncoder,
    EdgePathBias,
    GraphToken,
    SpatialBias,
    URPEScale,
    VirtualDistanceBias,
    static_form,
    distance_slots,
)
from graphormer_urpe.data.task import get_task



@dataclass(frozen=True)
class AttentionVariant:
    """What an ``attention`` choice adds to softmax attention over the atoms.

    Args:
        bias: B (spatial + edge-path encodings, graph-token distance) added before the softmax.
        scale: C (URPE's per-distance scale tables) multiplied in after the softmax.
    """

    bias: bool
    scale: bool


#: Every ``attention`` choice: a new variant is one entry here plus what its flags build below.
ATTENTION_VARIANTS: dict[str, AttentionVariant] = {
    "urpe": AttentionVariant(bias=True, scale=True),
    "rpe": AttentionVariant(bias=True, scale=False),  # plain Graphormer
    "none": AttentionVariant(bias=False, scale=False),  # a plain transformer over atoms
}
AttentionKind = Literal[tuple(ATTENTION_VARIANTS)]  # the choices LightningCLI lists and checks


def attention_variant(name: str) -> AttentionVariant:
    """The variant called ``name``; a ``ValueError`` naming the choices when unknown."""
    if name not in ATTENTION_VARIANTS:
        raise ValueError(f"attention must be one of {tuple(ATTENTION_VARIANTS)}, got {name!r}")
    return ATTENTION_VARIANTS[name]

#: What the output head reads (:class:`GraphormerConfig`'s ``readout``) and its width in units
#: of ``hidden_dim``.
READOUTS: dict[str, int] = {"token": 1, "sum": 1, "token+sum": 2}

#: Kernels for which ``-inf`` in ``attn_bias`` masks a key exactly as ``key_padding_mask`` does.
_KERNELS_WITH_ADDITIVE_MASK = ("eager", "sdpa")


@dataclass(frozen=True)
class GraphormerConfig:
    """The backbone's architecture: everything :class:`Graphormer` builds from that is not a fact
    of the data (:class:`~graphormer_urpe.data.facts.DataFacts`). A field left
    ``None`` keeps the preset's value, so partial overrides compose in any order
    (``--model.backbone '{"num_layers": 4}'``, ``--model.backbone.attention rpe``, a config
    overlay that sets one key).

    Args:
        num_layers: transformer layers.
        hidden_dim: width of the token representations.
        ffn_dim: hidden width of each feed-forward block.
        num_heads: attention heads.
        attention: ``urpe`` (B and C), ``rpe`` (B only: plain Graphormer) or ``none``.
        share_urpe_scale: one C table for all layers instead of one per layer.
        dropout: on the embeddings and on each residual branch.
        attention_dropout: on the attention probabilities.
        activation_dropout: after the FFN's GELU.
        max_degree: larger degrees share the last degree embedding.
        max_spd: larger shortest-path distances share the last B and C entries.
        attention_impl: attention kernel (``eager``, ``sdpa``, or a registered fused kernel
            such as ``triton``).
        readout: what the output head reads (:data:`READOUTS`): ``token`` (Graphormer's graph
            token), ``sum`` (the atoms' vectors summed) or ``token+sum``.
    """

    num_layers: int | None = None
    hidden_dim: int | None = None
    ffn_dim: int | None = None
    num_heads: int | None = None
    attention: AttentionKind | None = None
    share_urpe_scale: bool | None = None
    dropout: float | None = None
    attention_dropout: float | None = None
    activation_dropout: float | None = None
    max_degree: int | None = None
    max_spd: int | None = None
    attention_impl: str | None = None
    readout: str | None = None

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "GraphormerConfig":
        """From a plain dict (a checkpoint's hyperparameters); unknown keys raise a ValueError
        naming the valid ones."""
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(values) - set(valid))
        if unknown:
            raise ValueError(f"unknown backbone keys {unknown}; valid keys: {valid}")
        return cls(**values)

    def as_dict(self) -> dict[str, Any]:
        """The fields that are set (not ``None``)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not None}

    def over(self, base: "GraphormerConfig") -> "GraphormerConfig":
        """``base`` with this config's set fields replacing its own."""
        return replace(base, **self.as_dict())

    @staticmethod
    def preset(name: str) -> "GraphormerConfig":
        """The complete config of a preset (:data:`PRESETS`); ValueError naming the presets."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return PRESETS[name]


class GraphormerLayer(nn.Module):
    """Pre-LayerNorm encoder block: ``x + Attn(LN(x))``, then ``x + FFN(LN(x))``.

    Shapes: x ``[B, N+1, D]``; attn_bias / attn_scale ``[B, H, N+1, N+1]`` or None;
    key_padding_mask ``[B, N+1]`` (True at padding) -> ``[B, N+1, D]``.
    """

    def __init__(self, hidden_dim: int, ffn_dim: int, num_heads: int, dropout: float,
                 attention_dropout: float, activation_dropout: float,
                 attention_impl: str = "eager") -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(hidden_dim)
        self.attn = URPEAttention(hidden_dim, num_heads, attention_dropout,
                                  attention_impl=attention_impl)
        self.ffn_norm = nn.LayerNorm(hidden_dim)
        self.ffn = nn.Sequential(
            nn.Linear(hidden_dim, ffn_dim),
            nn.GELU(),
            Dropout(activation_dropout),
            nn.Linear(ffn_dim, hidden_dim),
        )
        self.dropout = Dropout(dropout)

    def forward(self, x: Tensor, attn_bias: Tensor | None, attn_scale: Tensor | None,
                key_padding_mask: Tensor | None) -> Tensor:
        x = x + self.dropout(self.attn(self.attn_norm(x), attn_bias, attn_scale, key_padding_mask))
        return x + self.dropout(self.ffn(self.ffn_norm(x)))


class Graphormer(nn.Module):
    """Graph-level Graphormer: :class:`GraphBatch` -> ``[B, head width]``.

    Args:
        config: the architecture (:class:`GraphormerConfig`); fields left ``None`` are
            Graphormer-slim's (``PRESETS["slim"]``).
        facts: what the model takes from its data (:class:`~graphormer_urpe.data.facts.DataFacts`):
            the vocabulary sizes (padding id 0 included; ZINC: 29 atom, 5 bond ids), the task
            and ``num_targets`` (the head's width: :meth:`~graphormer_urpe.data.task.Task.head_width`),
            ``max_hops`` (the batches' ``path_edges`` must hold exactly as many) and
            ``node_encodings`` (``{name: width}`` of per-node float encodings such as
            ``{"rwse": 16}``, each embedded by a linear map added to the atom features; every
            batch must carry exactly these: :meth:`check_encodings`).

    ``Graphormer(PRESETS["slim"], DataFacts(num_atom_embeddings=29, num_bond_embeddings=5))`` is
    Graphormer-slim on ZINC; :meth:`from_preset` takes the same as keyword arguments.
    """

    def __init__(self, config: GraphormerConfig, facts: DataFacts) -> None:
        super().__init__()
        config = config.over(PRESETS["slim"])
        variant = attention_variant(config.attention)
        attention_kernel(config.attention_impl)  # ValueError naming the choices when unknown
        if variant.scale and config.attention_impl == "sdpa":
            raise ValueError(f"attention={config.attention!r} needs a kernel that applies C after the "
                             "softmax; attention_impl='sdpa' cannot (use 'eager')")
        for name, value in {"num_layers": config.num_layers,
                            "hidden_dim": config.hidden_dim, "ffn_dim": config.ffn_dim,
                            "num_heads": config.num_heads}.items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if config.readout not in READOUTS:
            raise ValueError(f"readout must be one of {list(READOUTS)}, got {config.readout!r}")
        task = get_task(facts.task)  # ValueError naming the tasks when unknown
        task.check_num_targets(facts.num_targets)
        self.config, self.facts = config, facts
        self.num_atom_embeddings = facts.num_atom_embeddings
        self.num_bond_embeddings = facts.num_bond_embeddings
        self.max_hops = facts.max_hops
        self.node_encodings = {name: int(width) for name, width in (facts.node_encodings or {}).items()}
        self.attention, self.variant = config.attention, variant
        self.max_spd = max_spd = config.max_spd
        self.num_heads = num_heads = config.num_heads
        self.attention_impl = config.attention_impl
        self.readout = config.readout
        #: ``[B, readout_width]`` is what the head reads (:meth:`embed`).
        self.readout_width = READOUTS[config.readout] * config.hidden_dim
        #: No per-batch host reads (set by :meth:`use_static_shapes`); not saved.
        self.static_shapes = False
        hidden_dim, num_layers = config.hidden_dim, config.num_layers

        self.atom_encoder = AtomEncoder(facts.num_atom_embeddings, hidden_dim)
        self.degree_encoder = DegreeEncoder(config.max_degree, hidden_dim)
        self.graph_token = GraphToken(hidden_dim)
        self.input_dropout = Dropout(config.dropout)
        if variant.bias:
            self.spatial_bias = SpatialBias(max_spd, num_heads)
            self.edge_bias = EdgePathBias(facts.num_bond_embeddings, num_heads, facts.max_hops)
            self.virtual_distance = VirtualDistanceBias(num_heads)
        self.urpe_scales = None
        if variant.scale:
            self.urpe_scales = nn.ModuleList(
                URPEScale(max_spd, num_heads) for _ in range(1 if config.share_urpe_scale else num_layers))
        self.layers = nn.ModuleList(
            GraphormerLayer(hidden_dim, config.ffn_dim, num_heads, config.dropout,
                            config.attention_dropout, config.activation_dropout, config.attention_impl)
            for _ in range(num_layers))
        self.final_norm = nn.LayerNorm(hidden_dim)
        self.num_descriptors = int(facts.num_descriptors)
        # a model without descriptors keeps the plain linear head (and its state dict's names)
        self.head = (DescriptorHead(self.readout_width, self.num_descriptors, hidden_dim,
                                    task.head_width(facts.num_targets)) if self.num_descriptors
                     else nn.Linear(self.readout_width, task.head_width(facts.num_targets)))
        if self.node_encodings:  # absent otherwise: the state dict of a model without them is unchanged
            self.node_encoders = nn.ModuleDict({name: nn.Linear(width, hidden_dim)
                                                for name, width in self.node_encodings.items()})
        #: The encodings with a static form, each switched by its ``static_shapes``
        #: (:func:`~graphormer_urpe.nn.encodings.static_form`): what :meth:`use_static_shapes` sets.
        self.static_form_encodings: tuple[nn.Module, ...] = (
            self.atom_encoder, self.degree_encoder,
            *((self.spatial_bias, self.edge_bias) if variant.bias else ()), *(self.urpe_scales or ()))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Graphormer v1's init: every linear layer ``N(0, 0.02 / sqrt(num_layers))`` with zero
        bias; embeddings ``N(0, 0.02)`` with zero padding rows; C = 1 (``delta = 0``);
        LayerNorm (1, 0)."""
        std = 0.02 / math.sqrt(len(self.layers))
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()
            elif module is not self and hasattr(module, "reset_parameters") and not isinstance(
                    module, (URPEAttention, nn.Embedding)):
                module.reset_parameters()  # the encodings (their own embeddings included) and C

    @classmethod
    def from_preset(cls, name: str, **arguments: Any) -> "Graphormer":
        """A preset (:data:`PRESETS`) with the data's facts and any architecture field as
        keyword arguments, e.g. ``Graphormer.from_preset("slim", num_atom_embeddings=29,
        num_bond_embeddings=5, attention="rpe")``."""
        config_names = {f.name for f in fields(GraphormerConfig)}
        unknown = sorted(set(arguments) - config_names - set(DataFacts.names()))
        if unknown:
            raise ValueError(f"unknown Graphormer arguments {unknown}; valid: "
                             f"{sorted(config_names)} (architecture), {list(DataFacts.names())} (data)")
        missing = [a for a in ("num_atom_embeddings", "num_bond_embeddings") if a not in arguments]
        if missing:
            raise ValueError(f"from_preset needs the data's vocabulary sizes: pass {missing}")
        config = GraphormerConfig(**{k: v for k, v in arguments.items() if k in config_names})
        facts = DataFacts(**{k: v for k, v in arguments.items() if k not in config_names})
        return cls(config.over(GraphormerConfig.preset(name)), facts)

    def urpe_scale_tables(self) -> Tensor:
        """The effective URPE scale ``C`` of every layer, float32 ``[num_layers, max_spd + 3, H]``
        (a detached copy), rows in the slot layout of
        :func:`~graphormer_urpe.nn.encodings.distance_slots`: row ``d`` is distance ``d``
        (``max_spd`` also serves longer ones), ``max_spd + 1`` unreachable, ``max_spd + 2`` the
        graph token's row and column. With ``share_urpe_scale`` every layer shows the shared
        table; ``"rpe"`` and ``"none"`` attention have ``C = 1`` everywhere."""
        num_layers, num_slots = len(self.layers), self.max_spd + 3
        if self.urpe_scales is None:
            return torch.ones(num_layers, num_slots, self.num_heads)
        tables = torch.stack([scale.table().detach().float() for scale in self.urpe_scales])
        return tables.expand(num_layers, -1, -1).clone() if len(tables) == 1 else tables.clone()

    def check_encodings(self, batch: GraphBatch) -> None:
        """ValueError unless ``batch`` carries exactly the encodings this model reads, of its
        widths: the data's encoding parameters must be the model's (``max_hops``,
        ``node_encodings``; a checkpoint records both)."""
        expected = {*CORE_ENCODINGS, *self.node_encodings}
        names = set(batch.encodings)
        if names != expected:
            raise ValueError(f"the batch carries encodings {sorted(names)} but the model reads {sorted(expected)}: "
                             "the data's encoding parameters must be those the model was built with "
                             f"(max_hops={self.max_hops}, node_encodings={self.node_encodings})")
        hops = batch.encodings["path_edges"].shape[-1]
        if hops != self.max_hops:
            raise ValueError(f"the batch's path_edges hold {hops} hops but the model's max_hops is "
                             f"{self.max_hops}: encode the data with max_hops={self.max_hops}")
        for name, width in self.node_encodings.items():
            values = batch.encodings[name]
            if values.shape != (*batch.node_mask.shape, width):
                raise ValueError(f"the batch's {name} is {list(values.shape)} but the model embeds "
                                 f"[B, N, {width}] (node_encodings={self.node_encodings})")

    def _check_batch(self, batch: GraphBatch) -> None:
        self.check_encodings(batch)
        carried = 0 if batch.descriptors is None else batch.descriptors.shape[-1]
        if carried != self.num_descriptors:
            raise ValueError(f"the batch carries {carried} molecule descriptors but the model reads "
                             f"{self.num_descriptors}: train and predict with --data.init_args.molecule_descriptors "
                             f"{'true' if self.num_descriptors else 'false'}")
        b, n = batch.node_mask.shape
        shapes = {"x": (batch.x.ndim == 3 and batch.x.shape[:2] == (b, n)),
                  "degree": batch.encodings["degree"].shape == (b, n),
                  "spd": batch.encodings["spd"].shape == (b, n, n),
                  "path_edges": batch.encodings["path_edges"].ndim == 4
                  and batch.encodings["path_edges"].shape[:3] == (b, n, n),
                  "edge_attr": batch.edge_attr.ndim == 2}
        bad = [name for name, ok in shapes.items() if not ok]
        if bad:
            raise ValueError(f"GraphBatch fields {bad} do not match node_mask [B={b}, N={n}] "
                             f"(x [B, N, F], degree [B, N], spd [B, N, N], path_edges [B, N, N, K], "
                             f"edge_attr [E+1, Fe])")
        if batch.x.device.type != "cpu" or self.static_shapes:
            # On an accelerator an out-of-range id fails loudly (device-side assert); checking here
            # would cost a host sync every step and stop the next step from being queued. A
            # static-shape model had its whole split's ids checked once (use_static_shapes).
            return
        self.check_ids(batch.x, batch.edge_attr)

    def check_ids(self, atom_ids, bond_ids) -> None:
        """ValueError when atom or bond ids (tensors or numpy arrays) fall outside the model's
        tables. On CPU an out-of-range id would silently read a wrong row."""
        if not (len(atom_ids) and len(bond_ids)):
            return
        x_lo, x_hi, e_lo, e_hi = (int(bound) for bound in (atom_ids.min(), atom_ids.max(),
                                                           bond_ids.min(), bond_ids.max()))
        if x_lo < 0 or x_hi >= self.num_atom_embeddings:
            raise ValueError(f"atom ids span [{x_lo}, {x_hi}] but num_atom_embeddings="
                             f"{self.num_atom_embeddings}")
        if e_lo < 0 or e_hi >= self.num_bond_embeddings:
            raise ValueError(f"bond ids span [{e_lo}, {e_hi}] but num_bond_embeddings="
                             f"{self.num_bond_embeddings}")

    def use_static_shapes(self, atom_ids, bond_ids) -> None:
        """Switch the training forward to what a CUDA graph can hold, on any device: no value read
        back to the host and no shape that depends on the data. The ids of everything it will see
        (a whole training split: ``atom_ids``, ``bond_ids``) are checked here, once, instead of
        per batch, and the encodings take their static form on every device
        (:func:`~graphormer_urpe.nn.encodings.static_form`, as they do on a GPU anyway).
        The training step calls it on a GPU, for batches of one shape (on a CPU, only where a test
        or benchmark asks for the GPU's forward); the values stay the same up to float rounding
        (the edge encoding sums the hops in another order)."""
        self.check_ids(atom_ids, bond_ids)
        self.static_shapes = True
        for encoding in self.static_form_encodings:
            encoding.static_shapes = True

    def attention_inputs(self, batch: GraphBatch) -> tuple[Tensor | None, Iterable[Tensor | None]]:
        """``B`` ``[B, H, N+1, N+1]`` (None for ``"none"``) and the ``C`` each layer uses
        (``[B, H, N+1, N+1]``, the same tensor for every layer when shared; None unless
        ``"urpe"``), in layer order: a list when autograd records the static form (all layers'
        C from one product), else a generator that gathers each layer's C when it is reached."""
        if not self.variant.bias:
            return None, [None] * len(self.layers)
        slots = distance_slots(batch.encodings["spd"], self.max_spd)  # [B, N, N]
        node_bias = self.spatial_bias(slots) + self.edge_bias(batch.edge_attr, batch.encodings["path_edges"])
        attn_bias = self.virtual_distance(node_bias)
        if self.urpe_scales is None:
            return attn_bias, [None] * len(self.layers)
        scale_slots = URPEScale.slots(slots, self.max_spd)
        scales = self.urpe_scales
        if (torch.is_grad_enabled() and scales[0].by_product
                and static_form(scales[0].static_shapes, scale_slots)):
            looked_up = URPEScale.lookup_many(scales, scale_slots)  # all layers in one product
        else:
            # Each layer's C is gathered when the layer runs (without autograd one
            # [B, H, N+1, N+1] table is alive instead of L).
            scale_slots = scale_slots.long()
            looked_up = (scale(scale_slots) for scale in scales)
        if len(scales) == 1:
            return attn_bias, list(looked_up) * len(self.layers)
        return attn_bias, looked_up

    def node_features(self, batch: GraphBatch) -> Tensor:
        """Each atom's input vector ``[B, N, D]``: its atom and degree embeddings plus the node
        encodings; what :meth:`forward` starts from."""
        node_mask = batch.node_mask
        nodes = self.atom_encoder(batch.x) + self.degree_encoder(batch.encodings["degree"], node_mask)
        for name, encoder in (self.node_encoders.items() if self.node_encodings else ()):
            nodes = nodes + encoder(batch.encodings[name].to(nodes.dtype)) * node_mask[..., None]
        return nodes

    def forward(self, batch: GraphBatch, nodes: Tensor | None = None) -> Tensor:
        """Outputs ``[B, head width]``: the head applied to :meth:`embed`; ``nodes`` replaces
        :meth:`node_features` (attributions: :mod:`graphormer_urpe.prediction.explain` scales them along a
        path)."""
        return self.output(self.embed(batch, nodes), batch)

    def output(self, readout: Tensor, batch: GraphBatch) -> Tensor:
        """The head's outputs ``[B, head width]`` from :meth:`embed`'s ``readout`` (and the
        batch's molecule descriptors, for a model that reads them)."""
        return self.head(readout, batch.descriptors) if self.num_descriptors else self.head(readout)

    def embed(self, batch: GraphBatch, nodes: Tensor | None = None) -> Tensor:
        """Each molecule's representation ``[B, readout_width]``, which the output head reads
        (:meth:`forward`): the :attr:`readout` of the final states after the last LayerNorm
        (the graph token's ``LN(h^{(L)})_0``, the atoms' sum, or both)."""
        h = self._token_states(batch, nodes)
        if self.readout == "token":
            return self.final_norm(h[:, 0])
        return self._read_out(self.final_norm(h), batch.node_mask)[0]

    def embed_atoms(self, batch: GraphBatch) -> tuple[Tensor, Tensor]:
        """:meth:`embed`'s ``[B, readout_width]`` and each atom's final vector ``[B, N, D]``
        after the same LayerNorm (zero at padding), from one pass."""
        return self._read_out(self.final_norm(self._token_states(batch)), batch.node_mask)

    def _read_out(self, states: Tensor, node_mask: Tensor) -> tuple[Tensor, Tensor]:
        """``(readout [B, readout_width], atoms [B, N, D] zero at padding)`` of the normed final
        states ``[B, N+1, D]``."""
        atoms = states[:, 1:].masked_fill(~node_mask[..., None], 0.0)
        if self.readout == "token":
            return states[:, 0], atoms
        summed = atoms.sum(dim=1)
        return (summed if self.readout == "sum" else torch.cat([states[:, 0], summed], dim=-1)), atoms

    def _token_states(self, batch: GraphBatch, nodes: Tensor | None = None) -> Tensor:
        """``h^{(L)}`` ``[B, N+1, D]``, the graph token at index 0 (before the final LayerNorm)."""
        self._check_batch(batch)
        node_mask = batch.node_mask
        if nodes is None:
            nodes = self.node_features(batch)
        h = self.input_dropout(self.graph_token(nodes))  # [B, N+1, D]
        token_is_real = torch.zeros_like(node_mask[:, :1])
        key_padding_mask = torch.cat([token_is_real, ~node_mask], dim=1)  # [B, N+1]
        attn_bias, scales = self.attention_inputs(batch)
        if attn_bias is not None and self.attention_impl in _KERNELS_WITH_ADDITIVE_MASK:
            # Padded keys as -inf in the bias every layer shares: masked once, not once per layer.
            attn_bias = attn_bias.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
            key_padding_mask = None
        for layer, attn_scale in zip(self.layers, scales):
            h = layer(h, attn_bias, attn_scale, key_padding_mask)
        return h


class DescriptorHead(nn.Module):
    """The output head of a model that reads molecule descriptors beside its readout:
    ``out([readout; GELU(descriptors(s))])``, ``s`` the raw descriptors ``[B, D]`` clipped and
    standardized with ``statistics`` (``[4, D]``: low, high, mean, std of the training split,
    :func:`~graphormer_urpe.data.descriptors.clip_statistics`; a buffer, so the checkpoint keeps
    them), a descriptor that failed (NaN) at the training mean (0)."""

    def __init__(self, readout_width: int, num_descriptors: int, hidden_dim: int, out_width: int) -> None:
        super().__init__()
        self.register_buffer("statistics", torch.stack([
            torch.full((num_descriptors,), -math.inf), torch.full((num_descriptors,), math.inf),
            torch.zeros(num_descriptors), torch.ones(num_descriptors)]))
        self.descriptors = nn.Linear(num_descriptors, hidden_dim)
        self.out = nn.Linear(readout_width + hidden_dim, out_width)

    def set_statistics(self, statistics) -> None:
        """Standardize with ``statistics`` (low, high, mean, std; arrays of ``D`` each) from now on."""
        self.statistics.copy_(torch.as_tensor(np.stack(statistics), dtype=self.statistics.dtype))

    def forward(self, readout: Tensor, descriptors: Tensor) -> Tensor:
        s = standardize(descriptors.to(readout.dtype), tuple(self.statistics.to(readout.dtype)))
        projected = nn.functional.gelu(self.descriptors(torch.nan_to_num(s, nan=0.0)))
        return self.out(torch.cat([readout, projected], dim=-1))


#: Architecture presets, complete :class:`GraphormerConfig` instances. ``slim`` is
#: Graphormer-slim (Graphormer v1's ZINC model: 12 x 80, 8 heads, FFN 80), also the value of every
#: field a config leaves ``None``. ``small`` is Graphormer-small (Graphormer v1's PCQM4M model:
#: 6 x 512, 32 heads, FFN 512) with ``base``'s tables. ``base`` is Graphormer-base as
#: trained on PCQM4Mv2 (Graphormer's ``graphormer_base`` architecture and
#: ``examples/property_prediction/pcqv2.sh``: 12 x 768, 32 heads, FFN 768, dropout 0.0,
#: attention 0.1, activation 0.1, 512-row degree and spatial tables). ``small``'s dropouts are
#: Graphormer v1's PCQM4M-LSC recipe: input and residual 0.1, attention 0.1, none inside the FFN.
PRESETS: dict[str, GraphormerConfig] = {"slim": GraphormerConfig(
    num_layers=12, hidden_dim=80, ffn_dim=80, num_heads=8, attention="urpe", share_urpe_scale=False,
    dropout=0.0, attention_dropout=0.1, activation_dropout=0.1, max_degree=62, max_spd=38,
    attention_impl="eager", readout="token")}
PRESETS["base"] = replace(PRESETS["slim"], num_layers=12, hidden_dim=768, ffn_dim=768, num_heads=32,
                          dropout=0.0, attention_dropout=0.1, activation_dropout=0.1,
                          max_degree=510, max_spd=510)
PRESETS["small"] = replace(PRESETS["base"], num_layers=6, hidden_dim=512, ffn_dim=512,
                           dropout=0.1, attention_dropout=0.1, activation_dropout=0.0)


def build_backbone(facts: DataFacts, preset: str, backbone: GraphormerConfig | Mapping[str, Any]
                   ) -> tuple[Graphormer, GraphormerConfig]:
    """The :class:`Graphormer` of these data facts and architecture, and its complete config
    (``backbone``'s fields over the preset's); ValueError for an unknown preset or task."""
    if isinstance(backbone, Mapping):  # a checkpoint's hyperparameters
        backbone = GraphormerConfig.from_dict(backbone)
    resolved = backbone.over(GraphormerConfig.preset(preset))
    model = Graphormer(resolved, facts)
    return model, resolved


def count_parameters(model: nn.Module, trainable_only: bool = True) -> int:
    """Number of (trainable) parameters of ``model``."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)

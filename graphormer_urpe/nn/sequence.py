r"""A sequence Transformer encoder for the paper's synthetic tasks (Luo et al., 2022, Figure 1).

It shares :class:`~graphormer_urpe.nn.attention.URPEAttention` with the graph model; only the
way B and C are built differs. For a sequence, both are Toeplitz matrices indexed by the
relative offset ``j - i`` of key ``j`` and query ``i``:

.. math::
    B_{ij} = b^{(h)}_{j-i}, \qquad C_{ij} = c^{(h)}_{j-i}, \qquad
    A^{(h)} = \mathrm{softmax}\big(Q K^\top / \sqrt{d} + B^{(h)}\big) \odot C^{(h)}

Position schemes (``position``):

* ``"none"``: no position information (the encoder is permutation-equivariant).
* ``"ape"``: a learned absolute position embedding added to the token embedding.
* ``"rpe"``: T5-style relative bias, one learnable ``b_k`` per offset ``k`` and head
  (no buckets: every offset in ``[-(M-1), M-1]`` has its own entry); ``C`` is absent.
* ``"urpe"``: the RPE bias plus a learnable scale ``c_k`` per offset and head, initialised
  to 1, so an untrained URPE model computes exactly what the RPE model does.

Every layer has its own tables (the paper's Figure 2 shows them per layer and head).
"""
from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor, nn

from graphormer_urpe.nn.attention import URPEAttention

PositionScheme = Literal["none", "ape", "rpe", "urpe"]
POSITION_SCHEMES: tuple[str, ...] = get_args(PositionScheme)


def relative_offsets(length: int, max_len: int, device: torch.device | None = None) -> Tensor:
    """Table index of every (query ``i``, key ``j``) pair: ``(j - i) + max_len - 1``.

    Returns ``[L, L]`` int64 (an index tensor; gathers need it) with values in
    ``[0, 2 * max_len - 2]``; row ``i`` is the query, column ``j`` the key.
    """
    if not 0 < length <= max_len:
        raise ValueError(f"sequence length {length} is outside [1, max_len={max_len}]")
    pos = torch.arange(length, device=device)
    return pos[None, :] - pos[:, None] + (max_len - 1)


class RelativePositionTable(nn.Module):
    r"""One learnable value per relative offset and head, expanded to a Toeplitz matrix.

    ``table[h, k + M - 1]`` holds the value for offset ``k = j - i``, ``k`` in ``[-(M-1), M-1]``.

    Args:
        num_heads: ``H``.
        max_len: ``M``, the longest sequence the table covers.
        init: initial value of every entry (0 for a bias B, 1 for a URPE scale C).
    """

    def __init__(self, num_heads: int, max_len: int, init: float) -> None:
        super().__init__()
        self.max_len = max_len
        self.init = init
        self.table = nn.Parameter(torch.full((num_heads, 2 * max_len - 1), float(init)))

    def reset_parameters(self) -> None:
        nn.init.constant_(self.table, self.init)

    def forward(self, length: int) -> Tensor:
        """Returns the Toeplitz matrices ``[1, H, L, L]`` for a sequence of ``length`` tokens."""
        index = relative_offsets(length, self.max_len, self.table.device)
        return self.table[:, index].unsqueeze(0)

    def offsets(self) -> Tensor:
        """The offset ``j - i`` of each table column: ``[2M - 1]`` from ``-(M-1)`` to ``M-1``."""
        return torch.arange(-(self.max_len - 1), self.max_len)


class SequenceEncoderLayer(nn.Module):
    """Pre-LayerNorm Transformer layer (as in Graphormer): ``x + Attn(LN(x))``, ``x + FFN(LN(x))``.

    ``position`` decides which relative tables the layer owns: ``bias`` (B) for ``rpe`` and
    ``urpe``, ``scale`` (C) for ``urpe`` only.
    """

    def __init__(self, embed_dim: int, num_heads: int, ffn_dim: int, max_len: int,
                 position: PositionScheme, dropout: float = 0.0) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(embed_dim)
        self.attn = URPEAttention(embed_dim, num_heads, dropout=dropout)
        self.ffn_norm = nn.LayerNorm(embed_dim)
        self.ffn = nn.Sequential(nn.Linear(embed_dim, ffn_dim), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(ffn_dim, embed_dim))
        self.dropout = nn.Dropout(dropout)
        relative = position in ("rpe", "urpe")
        self.bias = RelativePositionTable(num_heads, max_len, init=0.0) if relative else None
        self.scale = RelativePositionTable(num_heads, max_len, init=1.0) if position == "urpe" else None

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        length = x.shape[1]
        attn_bias = self.bias(length) if self.bias is not None else None
        attn_scale = self.scale(length) if self.scale is not None else None
        h = self.attn(self.attn_norm(x), attn_bias, attn_scale, key_padding_mask)
        x = x + self.dropout(h)
        return x + self.dropout(self.ffn(self.ffn_norm(x)))


class SequenceTransformer(nn.Module):
    """Token-level classifier: embedding, ``num_layers`` URPE-attention layers, a linear head.

    Args:
        vocab_size: number of input token ids (``0 .. vocab_size - 1``).
        num_classes: outputs per position.
        max_len: longest sequence (sizes the APE table and the relative tables).
        position: one of :data:`POSITION_SCHEMES`.
        embed_dim, num_heads, num_layers, ffn_dim, dropout: encoder size.

    Shapes:
        tokens: ``[B, L]`` integer ids; key_padding_mask: ``[B, L]`` bool, True at padding.
        Returns logits ``[B, L, num_classes]``.
    """

    def __init__(self, vocab_size: int, num_classes: int, max_len: int,
                 position: PositionScheme = "urpe", embed_dim: int = 64, num_heads: int = 4,
                 num_layers: int = 3, ffn_dim: int = 128, dropout: float = 0.0) -> None:
        super().__init__()
        if position not in POSITION_SCHEMES:
            raise ValueError(f"position={position!r} is not one of {POSITION_SCHEMES}")
        for name, value in (("vocab_size", vocab_size), ("num_classes", num_classes),
                            ("max_len", max_len), ("num_layers", num_layers)):
            if value < 1:
                raise ValueError(f"{name}={value} must be positive")
        self.position = position
        self.max_len = max_len
        self.token_embedding = nn.Embedding(vocab_size, embed_dim)
        self.position_embedding = nn.Embedding(max_len, embed_dim) if position == "ape" else None
        self.layers = nn.ModuleList(
            SequenceEncoderLayer(embed_dim, num_heads, ffn_dim, max_len, position, dropout)
            for _ in range(num_layers))
        self.final_norm = nn.LayerNorm(embed_dim)
        self.head = nn.Linear(embed_dim, num_classes)

    def forward(self, tokens: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        return self.head(self.encode(tokens, key_padding_mask))

    def encode(self, tokens: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        """Hidden states ``[B, L, D]`` before the head (so a caller can classify only the
        positions it scores, which matters with a 10,000-way head)."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [B, L], got shape {tuple(tokens.shape)}")
        length = tokens.shape[1]
        if length > self.max_len:
            raise ValueError(f"sequence length {length} exceeds max_len={self.max_len}")
        x = self.token_embedding(tokens)
        if self.position_embedding is not None:
            x = x + self.position_embedding.weight[:length]
        for layer in self.layers:
            x = layer(x, key_padding_mask)
        return self.final_norm(x)

    def relative_tables(self) -> dict[str, Tensor]:
        """The learned per-offset tables, ``{"bias": [layers, H, 2M-1], "scale": ...}``.

        Only the tables the scheme has are returned (none for ``none``/``ape``).
        """
        tables: dict[str, Tensor] = {}
        for name in ("bias", "scale"):
            per_layer = [getattr(layer, name) for layer in self.layers]
            if per_layer[0] is not None:
                tables[name] = torch.stack([t.table.detach() for t in per_layer])
        return tables

r"""Multi-head self-attention with a relative-position bias and a URPE scale.

URPE attention (Luo et al., 2022, eq. 4):

.. math::
    \mathrm{Attn}(X) = \Big(\mathrm{softmax}\big(\tfrac{QK^\top}{\sqrt{d}} + B\big) \odot C\Big) V

``B`` (``attn_bias``) is added before the softmax, as in every RPE transformer; ``C``
(``attn_scale``) multiplies the probabilities element-wise after it, so a row of attention no
longer has to sum to one. With ``C = 1`` the module is plain RPE attention, bit for bit; with
``B = 0`` and ``C = 1`` it is plain softmax attention. Building B and C from positions is the
caller's job (graph encodings or sequence offsets); this module only applies them, so the graph
and sequence models share one attention.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn


class URPEAttention(nn.Module):
    """Self-attention ``(softmax(QK^T / sqrt(d) + B) ⊙ C) V``.

    Args:
        embed_dim: model width ``D``; split into ``num_heads`` heads of ``D / num_heads``.
        num_heads: number of heads ``H``.
        dropout: dropout on the (scaled) attention probabilities.

    Shapes:
        x: ``[B, L, D]``; attn_bias and attn_scale: ``[B, H, L, L]`` or broadcastable
        (e.g. ``[1, H, L, L]`` for sequences); key_padding_mask: ``[B, L]``, True at padding.
        Returns ``[B, L, D]`` and, with ``need_weights``, the probabilities ``[B, H, L, L]``
        after the scale and before dropout.
    """

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim={embed_dim} is not divisible by num_heads={num_heads}")
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.in_proj = nn.Linear(embed_dim, 3 * embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        self.dropout = nn.Dropout(dropout)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Graphormer initialises q, k, v with gain 1/sqrt(2) (as fairseq does for joint projections).
        nn.init.xavier_uniform_(self.in_proj.weight, gain=1 / math.sqrt(2))
        nn.init.zeros_(self.in_proj.bias)
        nn.init.xavier_uniform_(self.out_proj.weight)
        nn.init.zeros_(self.out_proj.bias)

    def forward(
        self,
        x: Tensor,
        attn_bias: Tensor | None = None,
        attn_scale: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        batch, length, _ = x.shape
        qkv = self.in_proj(x).view(batch, length, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, H, L, d]
        scores = torch.matmul(q, k.transpose(-1, -2)) * (self.head_dim ** -0.5)
        if attn_bias is not None:
            scores = scores + attn_bias
        if key_padding_mask is not None:
            scores = scores.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
        # The softmax runs in float32 under autocast: bf16 row sums lose the URPE signal.
        probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
        if attn_scale is not None:
            probs = probs * attn_scale.to(v.dtype)
        out = torch.matmul(self.dropout(probs), v)
        out = self.out_proj(out.transpose(1, 2).reshape(batch, length, self.embed_dim))
        return (out, probs) if need_weights else out

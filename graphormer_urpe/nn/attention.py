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

The core ``(q, k, v, B, C, mask) -> out`` is a swappable kernel chosen by name
(``attention_impl``, see :data:`ATTENTION_IMPLS`). ``"eager"`` is the reference written out in
PyTorch ops; ``"sdpa"`` hands RPE / plain attention (no ``C``) to
:func:`torch.nn.functional.scaled_dot_product_attention`. A fused URPE kernel registers itself
in :data:`ATTENTION_IMPLS` under a new name and is tested against ``"eager"``.
"""
from __future__ import annotations

import importlib
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from graphormer_urpe.nn.dropout import dropout

#: ``kernel(q, k, v, attn_bias, attn_scale, key_padding_mask, dropout_p, need_weights)`` with
#: q, k, v ``[B, H, L, d]``; returns ``(out [B, H, L, d], probs [B, H, L, L] or None)``.
AttentionKernel = Callable[
    [Tensor, Tensor, Tensor, "Tensor | None", "Tensor | None", "Tensor | None", float, bool],
    "tuple[Tensor, Tensor | None]",
]


def eager_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_bias: Tensor | None,
    attn_scale: Tensor | None,
    key_padding_mask: Tensor | None,
    dropout_p: float,
    need_weights: bool,
) -> tuple[Tensor, Tensor | None]:
    """The reference kernel: ``dropout(softmax(q k^T / sqrt(d) + B) ⊙ C) v``.

    Precision: the whole core runs in ``promote_types(q.dtype, float32)`` with autocast off:
    float32 for bf16 / fp16 / float32 inputs, float64 for a float64 model (never less than its
    input); only the result is cast back to v's dtype. URPE's signal is C's deviation from 1
    and the resulting deviation of row sums from 1; bf16 spaces values near 1 by 2^-7 ≈ 0.008
    (and a probability ``p`` by about ``p / 128``), so a bf16 product ``P ⊙ C`` or a bf16 ``P``
    in the value matmul would round most of a trained C away. For graph-sized ``L`` the float32
    core costs little next to the projections; a fused kernel is the place to go faster.
    The returned weights are in the core's dtype.
    """
    core = torch.promote_types(q.dtype, torch.float32)
    with torch.autocast(device_type=q.device.type, enabled=False):
        q, k, v_core = q.to(core), k.to(core), v.to(core)
        batch, heads, len_q, head_dim = q.shape
        len_k = k.shape[-2]
        q3, k3 = q.reshape(-1, len_q, head_dim), k.reshape(-1, len_k, head_dim)
        if attn_bias is None:
            scores = torch.bmm(q3, k3.transpose(1, 2)).mul_(head_dim ** -0.5)
        else:  # B + QK^T / sqrt(d) in one pass (a broadcast B, e.g. [1, H, L, L], is expanded)
            bias = attn_bias.to(core).expand(batch, heads, len_q, len_k).reshape(-1, len_q, len_k)
            scores = torch.baddbmm(bias, q3, k3.transpose(1, 2), alpha=head_dim ** -0.5)
        scores = scores.view(batch, heads, len_q, len_k)
        if key_padding_mask is not None:  # in place: the score product's backward needs q and k only
            scores.masked_fill_(key_padding_mask[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if attn_scale is not None:
            # Without autograd the probabilities are scaled in place (no [B, H, L, L] copy).
            scale = attn_scale.to(core)
            probs = probs * scale if torch.is_grad_enabled() else probs.mul_(scale)
        out = torch.matmul(dropout(probs, dropout_p), v_core)
    return out.to(v.dtype), (probs if need_weights else None)


def sdpa_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_bias: Tensor | None,
    attn_scale: Tensor | None,
    key_padding_mask: Tensor | None,
    dropout_p: float,
    need_weights: bool,
) -> tuple[Tensor, Tensor | None]:
    """PyTorch's fused ``scaled_dot_product_attention`` for RPE / plain attention.

    It has no hook between the softmax and the value product, so it cannot apply URPE's ``C``;
    B and the padding mask travel as one additive float mask in q's dtype.
    """
    if attn_scale is not None:
        raise ValueError("attention_impl='sdpa' cannot apply the URPE scale C (it multiplies the "
                         "probabilities after the softmax); use attention_impl='eager'")
    if need_weights:
        raise ValueError("attention_impl='sdpa' does not return attention weights; "
                         "use attention_impl='eager' with need_weights=True")
    mask = None
    if attn_bias is not None:
        mask = attn_bias.to(q.dtype)
    if key_padding_mask is not None:
        pad = torch.zeros(key_padding_mask.shape, dtype=q.dtype, device=q.device)
        pad = pad.masked_fill(key_padding_mask, float("-inf"))[:, None, None, :]
        mask = pad if mask is None else mask + pad
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
    return out, None


#: Attention kernels by name; ``"eager"`` is the reference every other kernel is tested against.
ATTENTION_IMPLS: dict[str, AttentionKernel] = {"eager": eager_attention, "sdpa": sdpa_attention}
#: Kernels in their own module (heavy or optional imports) that register themselves on import.
_SELF_REGISTERING_IMPLS = {"triton": "graphormer_urpe.nn.fused_attention"}


def attention_kernel(name: str) -> AttentionKernel:
    """The kernel registered as ``name``, importing a self-registering one on first use."""
    if name not in ATTENTION_IMPLS and name in _SELF_REGISTERING_IMPLS:
        try:
            importlib.import_module(_SELF_REGISTERING_IMPLS[name])
        except ImportError as exc:
            raise ValueError(f"attention_impl={name!r} is unavailable: {exc}") from exc
    if name not in ATTENTION_IMPLS:
        raise ValueError(f"unknown attention_impl {name!r}; choose one of "
                         f"{sorted({*ATTENTION_IMPLS, *_SELF_REGISTERING_IMPLS})}")
    return ATTENTION_IMPLS[name]


class URPEAttention(nn.Module):
    """Self-attention ``(softmax(QK^T / sqrt(d) + B) ⊙ C) V``.

    Args:
        embed_dim: model width ``D``; split into ``num_heads`` heads of ``D / num_heads``.
        num_heads: number of heads ``H``.
        dropout: dropout on the (scaled) attention probabilities.
        attention_impl: name of the kernel in :data:`ATTENTION_IMPLS` (``"eager"`` = reference).

    Shapes:
        x: ``[B, L, D]``; attn_bias and attn_scale: ``[B, H, L, L]`` or broadcastable
        (e.g. ``[1, H, L, L]`` for sequences); key_padding_mask: ``[B, L]``, True at padding.
        Returns ``[B, L, D]`` and, with ``need_weights``, the probabilities ``[B, H, L, L]``
        after the scale and before dropout (in the eager core's dtype: at least float32).
    """

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0,
                 attention_impl: str = "eager") -> None:
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim={embed_dim} is not divisible by num_heads={num_heads}")
        attention_kernel(attention_impl)  # fail at construction, not at the first batch
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.attention_impl = attention_impl
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
        kernel = attention_kernel(self.attention_impl)
        dropout_p = self.dropout.p if self.training else 0.0
        out, probs = kernel(q, k, v, attn_bias, attn_scale, key_padding_mask, dropout_p,
                            need_weights)
        out = self.out_proj(out.transpose(1, 2).reshape(batch, length, self.embed_dim))
        return (out, probs) if need_weights else out

r"""Fused (flash-style) URPE attention in Triton, with an eager fallback and a dispatcher.

Per head, URPE attention (Luo et al., 2022) is

.. math::
    P = \mathrm{softmax}\big(S\big),\quad S = \tfrac{QK^\top}{\sqrt{d}} + B
    \ (\text{padded keys} = -\infty),\qquad A = P \odot C,\qquad O = A V.

The fused kernel never materialises ``S``, ``P`` or ``A``: it tiles over keys and keeps, per query
row, the running maximum ``m`` and the running normaliser ``l = \sum_j e^{s_j - m}`` of the
softmax *without* ``C`` (``C`` rescales the probabilities after the softmax, so it must not enter
the row sum), while the value accumulator gathers ``e^{s_j - m} C_j v_j``; the output is
``acc / l``. Only the log-sum-exp ``m + \log l`` per row is saved for the backward pass, which
recomputes ``P`` tile by tile (flash-attention-2 style). With ``dO`` the output gradient:

.. math::
    dV = A^\top dO,\quad dC = P \odot (dO\,V^\top),\quad dP = C \odot (dO\,V^\top),\\
    dS = P \odot \big(dP - \mathrm{rowsum}(dP \odot P)\big),\quad dB = dS,\quad
    dQ = dS\,K / \sqrt{d},\quad dK = dS^\top Q / \sqrt{d},

and ``rowsum(dP ⊙ P) = rowsum(dO ⊙ O)`` because ``O = (P ⊙ C) V``, so the backward needs one
dot product per row instead of a pass over ``P``. See ``docs/fused_attention.md``.

Precision: every kernel accumulates in float32. With bf16/fp16 inputs the float32 operands of the
MMAs (``P ⊙ C`` and ``dS``) are split into two 16-bit parts, so they keep ~16 mantissa bits (the
eager path computes in float32; a single bf16 operand would round a C near 1 to steps of 2^-7),
and the forward keeps an unrounded float32 copy of ``O`` for ``rowsum(dO ⊙ O)``.

Dropout (on ``P ⊙ C``, as in the eager path) multiplies by ``M = keep / (1 - p)`` drawn from
Philox at each entry's flat index, regenerated in the backward rather than stored; with it
``O = (P ⊙ C ⊙ M) V``, ``dV = (P ⊙ C ⊙ M)^T dO`` and ``M`` multiplies ``dO V^T`` before the
formulas above.

:func:`fused_attention_kernel`, which importing this module registers as
``URPEAttention(attention_impl="triton")``, uses the fused path for CUDA tensors (and for CPU
tensors under Triton's interpreter, ``TRITON_INTERPRET=1``, where the tests run whole models on
the kernels) and the eager one (:func:`~graphormer_urpe.nn.attention.eager_attention`)
otherwise. A query row whose keys are
all padding gives ``0`` here (the eager softmax gives NaN); Graphormer never produces one, since
the graph token at index 0 is never padding.
"""
from __future__ import annotations

import os

import torch
from torch import Tensor

from graphormer_urpe.nn.attention import ATTENTION_IMPLS, eager_attention

try:  # Triton is optional: without it only the eager path exists.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None


def _triton_interprets() -> bool:
    """Whether ``@triton.jit`` builds interpreted kernels now (``TRITON_INTERPRET=1``)."""
    try:
        from triton import knobs  # triton >= 3.4
    except ImportError:
        return os.environ.get("TRITON_INTERPRET", "0") == "1"
    return bool(knobs.runtime.interpret)


#: True when this module's kernels were built by Triton's CPU interpreter (``TRITON_INTERPRET=1``
#: at import time); they then run on CPU tensors, which is how the tests check them without a GPU.
TRITON_INTERPRETED: bool = triton is not None and _triton_interprets()


def _check_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_bias: Tensor | None,
    attn_scale: Tensor | None,
    key_padding_mask: Tensor | None,
) -> None:
    """Raise ``ValueError`` naming the first input whose shape, dtype or device is wrong."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be [B, H, L, d]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            "q [B, H, Lq, d], k and v [B, H, Lk, d] disagree: "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must share a device; got {q.device}, {k.device}, {v.device}")
    batch, heads, len_q, _ = q.shape
    len_k = k.shape[2]
    for name, table in (("attn_bias", attn_bias), ("attn_scale", attn_scale)):
        if table is None:
            continue
        if (
            table.dim() != 4
            or table.shape[0] not in (1, batch)
            or table.shape[1] not in (1, heads)
            or table.shape[2:] != (len_q, len_k)
        ):
            raise ValueError(
                f"{name} must be [B, H, Lq, Lk] = [{batch}, {heads}, {len_q}, {len_k}] or have "
                f"size 1 in the batch / head dims; got {tuple(table.shape)}"
            )
        if not table.is_floating_point():
            raise ValueError(f"{name} must be a floating tensor; got {table.dtype}")
        if table.device != q.device:
            raise ValueError(f"{name} is on {table.device} but q is on {q.device}")
    if key_padding_mask is not None:
        if key_padding_mask.dtype != torch.bool or key_padding_mask.shape != (batch, len_k):
            raise ValueError(
                f"key_padding_mask must be bool [B, Lk] = [{batch}, {len_k}]; "
                f"got {key_padding_mask.dtype} {tuple(key_padding_mask.shape)}"
            )
        if key_padding_mask.device != q.device:
            raise ValueError(f"key_padding_mask is on {key_padding_mask.device} but q is on {q.device}")


if triton is not None:

    @triton.jit
    def _dot(a, b, INPUT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
        """``a @ b`` accumulated in float32. ``DOT_UPCAST`` (bf16 under the CPU interpreter only,
        whose bf16 ``dot`` multiplies the raw uint16 storage) computes the same exact products in
        float32 instead, as the GPU's bf16 MMA does."""
        if DOT_UPCAST:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        return tl.dot(a, b, input_precision=INPUT_PRECISION)

    @triton.jit
    def _dot_f32_lhs(a, b, INPUT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, SPLIT: tl.constexpr):
        """``a @ b`` for a float32 ``a`` (probabilities, dS) and ``b`` in the storage dtype.

        With ``SPLIT`` (16-bit inputs) ``a`` is split into ``hi + lo``, both in b's dtype, and
        two MMAs run: ``a`` then keeps ~16 mantissa bits instead of bf16's 8, which matters for
        URPE (a trained C is close to 1 and bf16 spaces values near 1 by 2^-7). The extra MMA is
        cheap: the kernels are bound by reading the [L, L] tables B and C, not by MMAs.
        """
        a_hi = a.to(b.dtype)
        out = _dot(a_hi, b, INPUT_PRECISION, DOT_UPCAST)
        if SPLIT:
            a_lo = (a - a_hi.to(tl.float32)).to(b.dtype)
            out += _dot(a_lo, b, INPUT_PRECISION, DOT_UPCAST)
        return out

    @triton.jit
    def _dropout_scale(Seed, dropout_p, pid_bh, offs_m, offs_n, len_q, len_k):
        """``keep / (1 - p)`` per (query, key) tile entry. The Philox stream is indexed by the
        entry's flat position in ``[B·H, Lq, Lk]``, so the forward and both backward kernels (and
        :func:`dropout_keep_scale`) regenerate the same mask whatever their tiling. The seed is
        read from device memory (``Seed``, one int64), so a CUDA graph that draws it with
        ``torch.randint`` gets a new mask every replay."""
        seed = tl.load(Seed)
        rows = pid_bh.to(tl.int64) * len_q + offs_m
        keep = tl.rand(seed, rows[:, None] * len_k + offs_n[None, :]) >= dropout_p
        return tl.where(keep, 1.0 / (1.0 - dropout_p), 0.0)

    @triton.jit
    def _dropout_scale_kernel(Out, Seed, dropout_p, len_q, len_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        for start_n in range(0, len_k, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            keep_scale = _dropout_scale(Seed, dropout_p, pid_bh, offs_m, offs_n, len_q, len_k)
            offsets = (pid_bh.to(tl.int64) * len_q + offs_m)[:, None] * len_k + offs_n[None, :]
            tl.store(Out + offsets, keep_scale, mask=(offs_m < len_q)[:, None] & (offs_n < len_k)[None, :])

    @triton.jit
    def _scores_tile(
        q, k, Bias, bias_base, stride_bm, stride_bn, offs_m, offs_n, tile_valid, sm_scale,
        HAS_BIAS: tl.constexpr, INPUT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    ):
        """``q k^T * sm_scale + B`` for one [BLOCK_M, BLOCK_N] tile, in float32."""
        s = _dot(q, tl.trans(k), INPUT_PRECISION, DOT_UPCAST) * sm_scale
        if HAS_BIAS:
            bias = tl.load(
                Bias + bias_base + offs_m[:, None] * stride_bm + offs_n[None, :] * stride_bn,
                mask=tile_valid, other=0.0,
            )
            s += bias.to(tl.float32)
        return s

    @triton.jit
    def _grad_tile(
        q, k, v, do, lse, delta, Bias, bias_base, stride_bm, stride_bn,
        Scale, scale_base, stride_cm, stride_cn, offs_m, offs_n, tile_valid, sm_scale,
        Seed, dropout_p, pid_bh, len_q, len_k,
        HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, DROPOUT: tl.constexpr,
        INPUT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    ):
        """One [BLOCK_M, BLOCK_N] tile of the backward, recomputed from the forward's ``lse`` and
        ``delta = rowsum(dO ⊙ O)``: ``(P, ∂L/∂(P ⊙ C), A, dS)``, in float32, where ``A`` is what
        multiplied V (P times the dropout mask times C) and ``dS = P ⊙ (dP - delta)``. Both
        backward kernels call it, so they recompute dS alike."""
        s = _scores_tile(q, k, Bias, bias_base, stride_bm, stride_bn, offs_m, offs_n, tile_valid,
                         sm_scale, HAS_BIAS, INPUT_PRECISION, DOT_UPCAST)
        p = tl.where(tile_valid, tl.exp(s - lse[:, None]), 0.0)
        d_pc = _dot(do, tl.trans(v), INPUT_PRECISION, DOT_UPCAST)  # dO V^T: ∂L/∂(P ⊙ C), [M, N]
        a = p
        if DROPOUT:
            keep_scale = _dropout_scale(Seed, dropout_p, pid_bh, offs_m, offs_n, len_q, len_k)
            a = a * keep_scale
            d_pc = d_pc * keep_scale
        dp = d_pc
        if HAS_SCALE:
            scale = tl.load(
                Scale + scale_base + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn,
                mask=tile_valid, other=0.0,
            ).to(tl.float32)
            a = a * scale
            dp = dp * scale
        ds = p * (dp - delta[:, None])
        return p, d_pc, a, ds

    @triton.jit
    def _key_valid(Mask, mask_base, stride_mn, offs_n, len_k, HAS_MASK: tl.constexpr):
        """Keys inside the sequence and not padding."""
        valid = offs_n < len_k
        if HAS_MASK:
            padding = tl.load(Mask + mask_base + offs_n * stride_mn, mask=valid, other=1)
            valid = valid & (padding == 0)
        return valid

    @triton.jit
    def _urpe_fwd_kernel(
        Q, K, V, Bias, Scale, Mask, Out, OutF32, Lse,
        stride_qb, stride_qh, stride_qm, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vn, stride_vd,
        stride_bb, stride_bh, stride_bm, stride_bn,
        stride_cb, stride_ch, stride_cm, stride_cn,
        stride_mb, stride_mn,
        stride_ob, stride_oh, stride_om, stride_od,
        num_heads, len_q, len_k, head_dim, sm_scale, dropout_p, Seed,
        HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_MASK: tl.constexpr, DROPOUT: tl.constexpr,
        STORE_OUT_F32: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        INPUT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, SPLIT: tl.constexpr,
    ):
        """One program per query block. ``OutF32`` (16-bit inputs; contiguous [B, H, Lq, d]) keeps
        the unrounded output for the backward's ``rowsum(dO ⊙ O)``: from a bf16 O that row sum,
        and with it dB, dQ, dK, would carry bf16 rounding."""
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = (pid_bh // num_heads).to(tl.int64)  # 64-bit offsets: B·H·L² may pass 2^31
        h = pid_bh % num_heads
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        row_valid = offs_m < len_q
        d_valid = offs_d < head_dim
        q = tl.load(
            Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
            mask=row_valid[:, None] & d_valid[None, :], other=0.0,
        )
        bias_base = b * stride_bb + h * stride_bh
        scale_base = b * stride_cb + h * stride_ch
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for start_n in range(0, len_k, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            col_valid = _key_valid(Mask, b * stride_mb, stride_mn, offs_n, len_k, HAS_MASK)
            tile_valid = row_valid[:, None] & col_valid[None, :]
            k = tl.load(
                K + b * stride_kb + h * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                mask=(offs_n < len_k)[:, None] & d_valid[None, :], other=0.0,
            )
            s = _scores_tile(q, k, Bias, bias_base, stride_bm, stride_bn, offs_m, offs_n, tile_valid,
                             sm_scale, HAS_BIAS, INPUT_PRECISION, DOT_UPCAST)
            s = tl.where(col_valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # While every key so far is padding m is -inf; exp(-inf - 0) = 0 keeps l and acc at 0.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)  # the softmax normaliser: no C here
            if HAS_SCALE:
                scale = tl.load(
                    Scale + scale_base + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn,
                    mask=tile_valid, other=0.0,
                )
                p = p * scale.to(tl.float32)
            if DROPOUT:
                p = p * _dropout_scale(Seed, dropout_p, pid_bh, offs_m, offs_n, len_q, len_k)
            v = tl.load(
                V + b * stride_vb + h * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                mask=(offs_n < len_k)[:, None] & d_valid[None, :], other=0.0,
            )
            acc = acc * alpha[:, None] + _dot_f32_lhs(p, v, INPUT_PRECISION, DOT_UPCAST, SPLIT)
            m_i = m_new
        empty_row = l_i == 0.0
        out = acc / tl.where(empty_row, 1.0, l_i)[:, None]
        tl.store(
            Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
            out.to(Out.dtype.element_ty), mask=row_valid[:, None] & d_valid[None, :],
        )
        if STORE_OUT_F32:
            tl.store(
                OutF32 + pid_bh.to(tl.int64) * len_q * head_dim + offs_m[:, None] * head_dim + offs_d[None, :],
                out, mask=row_valid[:, None] & d_valid[None, :],
            )
        # +inf for a row with no key makes the backward's exp(s - lse) exactly 0 there.
        lse = tl.where(empty_row, float("inf"), m_i + tl.log(tl.where(empty_row, 1.0, l_i)))
        tl.store(Lse + pid_bh * len_q + offs_m, lse, mask=row_valid)

    @triton.jit
    def _urpe_bwd_dkdv_kernel(
        Q, K, V, Bias, Scale, Mask, DO, Lse, Delta, DK, DV, DBias, DScale,
        stride_qb, stride_qh, stride_qm, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vn, stride_vd,
        stride_bb, stride_bh, stride_bm, stride_bn,
        stride_cb, stride_ch, stride_cm, stride_cn,
        stride_mb, stride_mn,
        stride_dob, stride_doh, stride_dom, stride_dod,
        stride_dkb, stride_dkh, stride_dkn, stride_dkd,
        stride_dvb, stride_dvh, stride_dvn, stride_dvd,
        num_heads, len_q, len_k, head_dim, sm_scale, dropout_p, Seed,
        HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_MASK: tl.constexpr, DROPOUT: tl.constexpr,
        STORE_DBIAS: tl.constexpr, STORE_DSCALE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        INPUT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, SPLIT: tl.constexpr,
    ):
        """One program per key block: dK, dV and the dB, dC tiles of its columns.

        ``DBias`` and ``DScale`` are dense ``[B, H, Lq, Lk]`` (contiguous); each tile is written
        by exactly one program, so no atomics and the result is deterministic.
        """
        pid_n = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = (pid_bh // num_heads).to(tl.int64)  # 64-bit offsets: B·H·L² may pass 2^31
        h = pid_bh % num_heads
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        d_valid = offs_d < head_dim
        kv_valid = (offs_n < len_k)[:, None] & d_valid[None, :]
        col_valid = _key_valid(Mask, b * stride_mb, stride_mn, offs_n, len_k, HAS_MASK)
        k = tl.load(
            K + b * stride_kb + h * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
            mask=kv_valid, other=0.0,
        )
        v = tl.load(
            V + b * stride_vb + h * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
            mask=kv_valid, other=0.0,
        )
        bias_base = b * stride_bb + h * stride_bh
        scale_base = b * stride_cb + h * stride_ch
        grad_base = pid_bh.to(tl.int64) * len_q * len_k  # dense [B, H, Lq, Lk] gradients
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        for start_m in range(0, len_q, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            row_valid = offs_m < len_q
            tile_valid = row_valid[:, None] & col_valid[None, :]
            q_valid = row_valid[:, None] & d_valid[None, :]
            q = tl.load(
                Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=q_valid, other=0.0,
            )
            do = tl.load(
                DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod,
                mask=q_valid, other=0.0,
            )
            lse = tl.load(Lse + pid_bh * len_q + offs_m, mask=row_valid, other=float("inf"))
            delta = tl.load(Delta + pid_bh * len_q + offs_m, mask=row_valid, other=0.0)
            p, d_pc, a, ds = _grad_tile(
                q, k, v, do, lse, delta, Bias, bias_base, stride_bm, stride_bn,
                Scale, scale_base, stride_cm, stride_cn, offs_m, offs_n, tile_valid, sm_scale,
                Seed, dropout_p, pid_bh, len_q, len_k, HAS_BIAS, HAS_SCALE, DROPOUT, INPUT_PRECISION, DOT_UPCAST)
            dv += _dot_f32_lhs(tl.trans(a), do, INPUT_PRECISION, DOT_UPCAST, SPLIT)
            dk += _dot_f32_lhs(tl.trans(ds), q, INPUT_PRECISION, DOT_UPCAST, SPLIT)
            grad_offs = grad_base + offs_m[:, None] * len_k + offs_n[None, :]
            grad_store = row_valid[:, None] & (offs_n < len_k)[None, :]
            if STORE_DBIAS:
                tl.store(DBias + grad_offs, ds.to(DBias.dtype.element_ty), mask=grad_store)
            if STORE_DSCALE:
                tl.store(DScale + grad_offs, (p * d_pc).to(DScale.dtype.element_ty), mask=grad_store)
        dk *= sm_scale
        tl.store(
            DK + b * stride_dkb + h * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd,
            dk.to(DK.dtype.element_ty), mask=kv_valid,
        )
        tl.store(
            DV + b * stride_dvb + h * stride_dvh + offs_n[:, None] * stride_dvn + offs_d[None, :] * stride_dvd,
            dv.to(DV.dtype.element_ty), mask=kv_valid,
        )

    @triton.jit
    def _urpe_bwd_dq_kernel(
        Q, K, V, Bias, Scale, Mask, DO, Lse, Delta, DQ,
        stride_qb, stride_qh, stride_qm, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vn, stride_vd,
        stride_bb, stride_bh, stride_bm, stride_bn,
        stride_cb, stride_ch, stride_cm, stride_cn,
        stride_mb, stride_mn,
        stride_dob, stride_doh, stride_dom, stride_dod,
        stride_dqb, stride_dqh, stride_dqm, stride_dqd,
        num_heads, len_q, len_k, head_dim, sm_scale, dropout_p, Seed,
        HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_MASK: tl.constexpr, DROPOUT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        INPUT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, SPLIT: tl.constexpr,
    ):
        """One program per query block: dQ = dS K / sqrt(d), recomputing dS over all keys."""
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = (pid_bh // num_heads).to(tl.int64)  # 64-bit offsets: B·H·L² may pass 2^31
        h = pid_bh % num_heads
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        row_valid = offs_m < len_q
        d_valid = offs_d < head_dim
        q_valid = row_valid[:, None] & d_valid[None, :]
        q = tl.load(
            Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
            mask=q_valid, other=0.0,
        )
        do = tl.load(
            DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod,
            mask=q_valid, other=0.0,
        )
        lse = tl.load(Lse + pid_bh * len_q + offs_m, mask=row_valid, other=float("inf"))
        delta = tl.load(Delta + pid_bh * len_q + offs_m, mask=row_valid, other=0.0)
        bias_base = b * stride_bb + h * stride_bh
        scale_base = b * stride_cb + h * stride_ch
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for start_n in range(0, len_k, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            col_valid = _key_valid(Mask, b * stride_mb, stride_mn, offs_n, len_k, HAS_MASK)
            tile_valid = row_valid[:, None] & col_valid[None, :]
            kv_valid = (offs_n < len_k)[:, None] & d_valid[None, :]
            k = tl.load(
                K + b * stride_kb + h * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                mask=kv_valid, other=0.0,
            )
            v = tl.load(
                V + b * stride_vb + h * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                mask=kv_valid, other=0.0,
            )
            _, _, _, ds = _grad_tile(
                q, k, v, do, lse, delta, Bias, bias_base, stride_bm, stride_bn,
                Scale, scale_base, stride_cm, stride_cn, offs_m, offs_n, tile_valid, sm_scale,
                Seed, dropout_p, pid_bh, len_q, len_k, HAS_BIAS, HAS_SCALE, DROPOUT, INPUT_PRECISION, DOT_UPCAST)
            dq += _dot_f32_lhs(ds, k, INPUT_PRECISION, DOT_UPCAST, SPLIT)
        dq *= sm_scale
        tl.store(
            DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqd,
            dq.to(DQ.dtype.element_ty), mask=q_valid,
        )


def head_block(head_dim: int) -> int:
    """The kernels' tile width over the head dimension: its next power of two, at least 16 (the
    smallest ``tl.dot`` operand)."""
    return max(16, 1 << (head_dim - 1).bit_length())


def _launch_config(head_dim: int, dtype: torch.dtype) -> dict[str, dict]:
    """Tiles and warps per kernel (``fwd``, ``dkdv``, ``dq``); not autotuned.

    Chosen without a GPU from ptxas's register report for sm_90 (docs/fused_attention.md): the
    largest tiles that compile without register spills for 16-bit inputs and head_dim <= 128.
    float32 (IEEE dots run on FMA units, not tensor cores) gets smaller tiles and still spills a
    little in the dK/dV kernel. The kernels are bound by reading B and C, so tiles smaller than
    plain flash attention's cost little. float32 with heads of width <= 16 takes the fastest of
    ``scripts/bench_attention.py``'s configurations at Graphormer-slim's ZINC shape (38 tokens,
    width 10; docs/benchmarks.md).
    """
    block_d = head_block(head_dim)
    if TRITON_INTERPRETED:  # the interpreter's cost is per op, so small tiles keep tests quick
        tile = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_D=block_d, num_warps=1, num_stages=1)
        return {"fwd": tile, "dkdv": tile, "dq": tile}
    if dtype == torch.float32 and block_d <= 16:
        tile = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_D=block_d, num_warps=4, num_stages=2)
        return {"fwd": tile, "dkdv": tile, "dq": tile}
    if dtype == torch.float32:
        query_tile, dkdv_query_tile, warps = 32, 16, 8
    else:
        query_tile, dkdv_query_tile, warps = 64, 32, 4 if block_d <= 64 else 8
    common = dict(BLOCK_N=32, BLOCK_D=block_d, num_stages=2)
    return {
        "fwd": dict(BLOCK_M=query_tile, num_warps=warps, **common),
        "dkdv": dict(BLOCK_M=dkdv_query_tile, num_warps=8, **common),
        "dq": dict(BLOCK_M=query_tile, num_warps=warps, **common),
    }


def _input_precision(dtype: torch.dtype) -> str:
    """fp32 dot products follow torch's matmul setting (TF32 only when torch allows it)."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"


def _dot_flags(dtype: torch.dtype) -> dict:
    return dict(
        INPUT_PRECISION=_input_precision(dtype),
        DOT_UPCAST=TRITON_INTERPRETED and dtype == torch.bfloat16,
        SPLIT=dtype != torch.float32,
    )


def _table_strides(table: Tensor | None, shape: tuple[int, int, int, int]) -> tuple[int, ...]:
    """Strides of a [B, H, Lq, Lk] view of a (broadcast) bias/scale; 0 along broadcast dims."""
    return (0, 0, 0, 0) if table is None else table.expand(shape).stride()


class _FusedURPEAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, attn_bias, attn_scale, key_padding_mask, dropout_p, seed, config):
        batch, heads, len_q, head_dim = q.shape
        len_k = k.shape[2]
        table_shape = (batch, heads, len_q, len_k)
        # [B, Lq, H, d] storage viewed as [B, H, Lq, d]: the caller's transpose(1, 2).reshape is free.
        out = torch.empty(batch, len_q, heads, head_dim, dtype=q.dtype, device=q.device).transpose(1, 2)
        out_f32 = out if q.dtype == torch.float32 else torch.empty(
            batch, heads, len_q, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(batch * heads, len_q, dtype=torch.float32, device=q.device)
        mask = None if key_padding_mask is None else key_padding_mask.contiguous().view(torch.uint8)
        grid = (triton.cdiv(len_q, config["fwd"]["BLOCK_M"]), batch * heads)
        _urpe_fwd_kernel[grid](
            q, k, v, attn_bias, attn_scale, mask, out, out_f32, lse,
            *q.stride(), *k.stride(), *v.stride(),
            *_table_strides(attn_bias, table_shape), *_table_strides(attn_scale, table_shape),
            *(mask.stride() if mask is not None else (0, 0)),
            *out.stride(),
            heads, len_q, len_k, head_dim, head_dim ** -0.5, dropout_p, seed,
            HAS_BIAS=attn_bias is not None, HAS_SCALE=attn_scale is not None, HAS_MASK=mask is not None,
            DROPOUT=dropout_p > 0, STORE_OUT_F32=out_f32 is not out, **_dot_flags(q.dtype), **config["fwd"],
        )
        ctx.save_for_backward(q, k, v, attn_bias, attn_scale, mask, out_f32, lse)
        ctx.dropout_p, ctx.seed, ctx.config = dropout_p, seed, config
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k, v, attn_bias, attn_scale, mask, out_f32, lse = ctx.saved_tensors
        config = ctx.config
        batch, heads, len_q, head_dim = q.shape
        len_k = k.shape[2]
        table_shape = (batch, heads, len_q, len_k)
        # rowsum(dP ⊙ P) = rowsum(dO ⊙ O), since O = (P ⊙ C ⊙ M) V (M: the dropout multiplier).
        delta = (grad_out.float() * out_f32).sum(-1).reshape(batch * heads, len_q).contiguous()

        def dense_grad(table: Tensor | None, needed: bool) -> Tensor | None:
            if table is None or not needed:
                return None
            # Broadcast tables get a float32 per-(batch, head) gradient, summed afterwards.
            dtype = table.dtype if table.shape == table_shape else torch.float32
            return torch.empty(table_shape, dtype=dtype, device=q.device)

        d_bias = dense_grad(attn_bias, ctx.needs_input_grad[3])
        d_scale = dense_grad(attn_scale, ctx.needs_input_grad[4])
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        common = (
            *q.stride(), *k.stride(), *v.stride(),
            *_table_strides(attn_bias, table_shape), *_table_strides(attn_scale, table_shape),
            *(mask.stride() if mask is not None else (0, 0)),
            *grad_out.stride(),
        )
        flags = dict(
            HAS_BIAS=attn_bias is not None, HAS_SCALE=attn_scale is not None, HAS_MASK=mask is not None,
            DROPOUT=ctx.dropout_p > 0, **_dot_flags(q.dtype),
        )
        sizes = (heads, len_q, len_k, head_dim, head_dim ** -0.5, ctx.dropout_p, ctx.seed)
        _urpe_bwd_dkdv_kernel[(triton.cdiv(len_k, config["dkdv"]["BLOCK_N"]), batch * heads)](
            q, k, v, attn_bias, attn_scale, mask, grad_out, lse, delta, dk, dv, d_bias, d_scale,
            *common, *dk.stride(), *dv.stride(), *sizes,
            STORE_DBIAS=d_bias is not None, STORE_DSCALE=d_scale is not None, **flags, **config["dkdv"],
        )
        _urpe_bwd_dq_kernel[(triton.cdiv(len_q, config["dq"]["BLOCK_M"]), batch * heads)](
            q, k, v, attn_bias, attn_scale, mask, grad_out, lse, delta, dq,
            *common, *dq.stride(), *sizes, **flags, **config["dq"],
        )
        if d_bias is not None:
            d_bias = d_bias.sum_to_size(attn_bias.shape).to(attn_bias.dtype)
        if d_scale is not None:
            d_scale = d_scale.sum_to_size(attn_scale.shape).to(attn_scale.dtype)
        return dq, dk, dv, d_bias, d_scale, None, None, None, None


# Under torch.compile the fused kernels run as one opaque call (a graph break around them):
# inductor cannot lower this autograd.Function (it rejects the bool -> uint8 mask view, on torch 2.11).
@torch.compiler.disable
def fused_urpe_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_bias: Tensor | None = None,
    attn_scale: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    seed: int | None = None,
    launch_config: dict[str, dict] | None = None,
) -> Tensor:
    r"""URPE attention ``dropout(softmax(q k^T / sqrt(d) + B) ⊙ C) v`` with fused Triton kernels.

    Differentiable in ``q``, ``k``, ``v``, ``attn_bias`` and ``attn_scale`` (gradients of
    broadcast tables are summed over the broadcast dims). Inputs may be strided views.

    Args:
        q: ``[B, H, Lq, d]``; ``k``, ``v``: ``[B, H, Lk, d]``; float32, bfloat16 or float16,
            all one dtype (the kernels accumulate in float32).
        attn_bias: ``B``, ``[B, H, Lq, Lk]`` or size 1 in the batch / head dims; None means 0.
        attn_scale: ``C``, same shapes as ``attn_bias``; None means 1.
        key_padding_mask: bool ``[B, Lk]``, True at padding keys.
        dropout_p: dropout on ``P ⊙ C`` (pass 0 in evaluation). The mask is never stored: every
            kernel regenerates it from ``seed`` (see :func:`dropout_keep_scale`).
        seed: Philox seed of the dropout mask: an int, a one-element int64 tensor on q's device,
            or None, which draws one on the device from torch's default generator (no host
            sync, so the call can be recorded in a CUDA graph and every replay draws anew).
        launch_config: tiles and warps per kernel, as :func:`_launch_config` gives them (its
            default when None); ``scripts/bench_attention.py`` times alternatives.

    Returns:
        ``[B, H, Lq, d]`` in q's dtype, a view of ``[B, Lq, H, d]`` storage.
    """
    if triton is None:
        raise ValueError("fused_urpe_attention needs triton; install it or use attention_impl='eager'")
    _check_inputs(q, k, v, attn_bias, attn_scale, key_padding_mask)
    if not (q.is_cuda or TRITON_INTERPRETED):
        raise ValueError(
            f"fused_urpe_attention runs on CUDA tensors (got {q.device}); on CPU use attention_impl='eager' "
            "(or TRITON_INTERPRET=1 before importing this module, for testing)"
        )
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"fused_urpe_attention supports float32, bfloat16, float16; got {q.dtype}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"fused_urpe_attention needs 0 <= dropout_p < 1; got {dropout_p}")
    return _FusedURPEAttention.apply(
        q, k, v, attn_bias, attn_scale, key_padding_mask, float(dropout_p), seed_tensor(seed, q.device, dropout_p > 0),
        launch_config or _launch_config(q.shape[-1], q.dtype),
    )


def seed_tensor(seed: int | Tensor | None, device: torch.device, draw: bool = True) -> Tensor:
    """The kernels' Philox seed as a one-element int64 tensor on ``device``: ``seed`` as given,
    or (None) drawn there from torch's default generator, so ``torch.manual_seed`` reproduces
    runs and, on a GPU, a recorded CUDA graph draws a new seed every replay; 0 without
    ``draw`` (no dropout: the kernels never read it)."""
    device = torch.device(device)
    if isinstance(seed, Tensor):
        if seed.numel() != 1 or seed.dtype != torch.int64 or seed.device.type != device.type:
            raise ValueError(f"seed must be one int64 on {device}; got {seed.dtype} "
                             f"{list(seed.shape)} on {seed.device}")
        return seed.reshape(1)
    if seed is None and draw:
        return torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64, device=device)
    # A fill, not a copy from host memory (which a CUDA graph capture refuses).
    return torch.full((1,), int(seed or 0), dtype=torch.int64, device=device)


def dropout_keep_scale(
    shape: tuple[int, int, int, int], dropout_p: float, seed: int | Tensor, device: torch.device | str
) -> Tensor:
    """The float32 ``[B, H, Lq, Lk]`` multiplier ``keep / (1 - p)`` that the fused kernels apply
    to ``P ⊙ C`` for this ``seed``: eager attention with ``attn_scale = C * dropout_keep_scale(...)``
    reproduces a fused dropout run (tests, debugging)."""
    if triton is None:
        raise ValueError("dropout_keep_scale needs triton")
    batch, heads, len_q, len_k = shape
    out = torch.empty(shape, dtype=torch.float32, device=device)
    tile = _launch_config(16, torch.bfloat16)["dkdv"]
    grid = (triton.cdiv(len_q, tile["BLOCK_M"]), batch * heads)
    _dropout_scale_kernel[grid](out, seed_tensor(seed, torch.device(device)), float(dropout_p), len_q, len_k,
                                BLOCK_M=tile["BLOCK_M"], BLOCK_N=tile["BLOCK_N"])
    return out


def kernels_run_on(device: torch.device | str) -> bool:
    """Whether the fused kernels run on ``device``'s tensors: a CUDA device with triton
    importable, or any device under Triton's interpreter (:data:`TRITON_INTERPRETED`). Where they
    do not, ``attention_impl="triton"`` runs the eager core."""
    return triton is not None and (torch.device(device).type == "cuda" or TRITON_INTERPRETED)


def fused_attention_kernel(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_bias: Tensor | None,
    attn_scale: Tensor | None,
    key_padding_mask: Tensor | None,
    dropout_p: float,
    need_weights: bool,
) -> tuple[Tensor, Tensor | None]:
    """``ATTENTION_IMPLS["triton"]`` (``URPEAttention(attention_impl="triton")``): the fused
    kernels where they run (:func:`kernels_run_on`: CUDA tensors with triton importable, any
    tensors under Triton's interpreter), else the eager kernel. The eager kernel also takes a call
    that asks for the attention weights (the fused one never forms them) or drops everything
    (``dropout_p`` 1: ``1 / (1 - p)`` is infinite). ``dropout_p`` is already 0 outside training;
    the two paths draw different dropout masks."""
    if need_weights or dropout_p >= 1 or not kernels_run_on(q.device):
        return eager_attention(q, k, v, attn_bias, attn_scale, key_padding_mask, dropout_p, need_weights)
    return fused_urpe_attention(q, k, v, attn_bias, attn_scale, key_padding_mask, dropout_p), None


ATTENTION_IMPLS["triton"] = fused_attention_kernel

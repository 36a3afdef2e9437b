"""URPEAttention: the paper's core argument, exactness at C = 1, kernels, mixed precision."""
from __future__ import annotations

import pytest
import torch

from graphormer_urpe.nn.attention import ATTENTION_IMPLS, URPEAttention, eager_attention

D, H, L = 32, 4, 7


def _attention(seed: int = 0, **kwargs) -> URPEAttention:
    torch.manual_seed(seed)
    return URPEAttention(D, H, **kwargs).eval()


def test_rpe_cannot_tell_positions_apart_on_a_constant_sequence_but_urpe_can():
    """Luo et al.'s argument: softmax rows sum to one, so when every position holds the same
    token (V has identical rows) any bias B leaves every output equal; URPE's C does not."""
    attn = _attention()
    x = torch.randn(1, 1, D).expand(1, L, D)
    bias = 5 * torch.randn(1, H, L, L)  # strongly position-dependent
    out_rpe = attn(x, attn_bias=bias)
    torch.testing.assert_close(out_rpe, out_rpe[:, :1].expand_as(out_rpe), rtol=0, atol=1e-6)

    offsets = torch.arange(L)[:, None] - torch.arange(L)[None, :]
    scale = (1 + 0.1 * offsets.float()).expand(1, H, L, L)  # a Toeplitz C, as for sequences
    out_urpe = attn(x, attn_bias=bias, attn_scale=scale)
    spread = (out_urpe - out_urpe[:, :1]).abs().amax()
    assert spread > 1e-2, "URPE should give position-dependent outputs on a constant input"


def test_unit_scale_is_exactly_rpe():
    attn = _attention()
    x = torch.randn(2, L, D)
    bias = torch.randn(2, H, L, L)
    mask = torch.zeros(2, L, dtype=torch.bool)
    mask[1, -2:] = True
    assert torch.equal(attn(x, bias, torch.ones(2, H, L, L), mask), attn(x, bias, None, mask))


def test_weights_are_scaled_probabilities():
    attn = _attention()
    x = torch.randn(2, L, D)
    scale = torch.rand(1, H, L, L) + 0.5
    _, plain = attn(x, need_weights=True)
    _, scaled = attn(x, attn_scale=scale, need_weights=True)
    assert scaled.shape == (2, H, L, L)
    torch.testing.assert_close(plain.sum(-1), torch.ones(2, H, L))
    torch.testing.assert_close(scaled, plain * scale)


def _written_out_attention(q, k, v, bias, scale, mask):
    """``(softmax(q k^T / sqrt(d) + B, padded keys -inf) ⊙ C) v``, op by op as in the paper."""
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if bias is not None:
        scores = scores + bias
    if mask is not None:
        scores = scores.masked_fill(mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if scale is not None:
        probs = probs * scale
    return probs @ v, probs


@pytest.mark.parametrize("autograd", [True, False])
@pytest.mark.parametrize("bias_shape, with_scale, with_mask", [
    ((3, H, L, L), True, True), ((1, H, L, L), True, False), (None, True, True), ((3, H, L, L), False, True)])
def test_eager_kernel_is_the_written_out_formula(autograd, bias_shape, with_scale, with_mask):
    """The eager kernel's fused score product and in-place steps (inference) change nothing."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, H, L, D // H, generator=gen) for _ in range(3))
    bias = None if bias_shape is None else torch.randn(bias_shape, generator=gen)
    scale = torch.rand(3, H, L, L, generator=gen) + 0.5 if with_scale else None
    mask = torch.zeros(3, L, dtype=torch.bool) if with_mask else None
    if with_mask:
        mask[0, 4:] = True
        mask[2, 1:] = True
    expected_out, expected_probs = _written_out_attention(q, k, v, bias, scale, mask)
    with torch.set_grad_enabled(autograd):
        out, probs = eager_attention(q, k, v, bias, scale, mask, 0.0, True)
    torch.testing.assert_close(out, expected_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(probs, expected_probs, rtol=1e-6, atol=1e-6)
    if scale is not None:
        assert torch.equal(scale, scale.clone()), "the caller's C is never modified"


def test_float64_core_stays_float64():
    """A float64 model's core computes in float64 (never below its input): outputs and every
    gradient equal the written-out formula in float64 to ~1e-12; a float32 core would agree
    only to ~1e-7."""
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(3, H, L, D // H, generator=gen, dtype=torch.float64) for _ in range(3)]
    inputs += [torch.randn(3, H, L, L, generator=gen, dtype=torch.float64),
               torch.rand(3, H, L, L, generator=gen, dtype=torch.float64) + 0.5]
    mask = torch.zeros(3, L, dtype=torch.bool)
    mask[0, 4:] = True
    grad_out = torch.randn(3, H, L, D // H, generator=gen, dtype=torch.float64)
    results = []
    for kernel in (lambda *a: eager_attention(*a, mask, 0.0, True), _written_out_attention_masked(mask)):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out, probs = kernel(*leaves)
        torch.autograd.backward(out, grad_out)
        results.append([out, probs, *(t.grad for t in leaves)])
    assert results[0][0].dtype == results[0][1].dtype == torch.float64
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def _written_out_attention_masked(mask):
    return lambda q, k, v, bias, scale: _written_out_attention(q, k, v, bias, scale, mask)


def test_bf16_inputs_get_a_float32_core_without_autocast():
    q, k, v = (torch.randn(2, H, L, 8, dtype=torch.bfloat16) for _ in range(3))
    out, probs = eager_attention(q, k, v, None, torch.full((1, H, L, L), 1.003), None, 0.0, True)
    assert probs.dtype == torch.float32 and out.dtype == torch.bfloat16
    torch.testing.assert_close(probs.sum(-1), torch.full((2, H, L), 1.003), rtol=0, atol=1e-6)


@pytest.mark.parametrize("with_bias", [True, False])
def test_sdpa_kernel_matches_eager_reference(with_bias):
    eager = _attention(attention_impl="eager")
    fused = _attention(attention_impl="sdpa")
    fused.load_state_dict(eager.state_dict())
    x = torch.randn(3, L, D)
    bias = torch.randn(3, H, L, L) if with_bias else None
    mask = torch.zeros(3, L, dtype=torch.bool)
    mask[0, 4:] = True
    mask[2, 1:] = True
    torch.testing.assert_close(fused(x, bias, None, mask), eager(x, bias, None, mask),
                               rtol=1e-5, atol=1e-5)


def test_sdpa_kernel_refuses_the_urpe_scale():
    attn = _attention(attention_impl="sdpa")
    with pytest.raises(ValueError, match="URPE scale"):
        attn(torch.randn(1, L, D), attn_scale=torch.ones(1, H, L, L))


def test_bad_arguments_raise_value_error():
    with pytest.raises(ValueError, match="divisible"):
        URPEAttention(30, 4)
    with pytest.raises(ValueError, match="attention_impl"):
        URPEAttention(D, H, attention_impl="flash-urpe-not-registered")
    assert "eager" in ATTENTION_IMPLS


def test_scale_survives_bf16_autocast():
    """A C that differs from 1 by less than bf16's spacing at 1 (2^-7) must still act: the
    eager kernel applies it, and multiplies by V, in float32."""
    q, k, v = (torch.randn(2, H, L, 8, dtype=torch.bfloat16) for _ in range(3))
    scale = torch.full((1, H, L, L), 1.003)
    assert torch.equal(scale.bfloat16(), torch.ones_like(scale, dtype=torch.bfloat16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_1, probs_1 = eager_attention(q, k, v, None, None, None, 0.0, True)
        out_c, probs_c = eager_attention(q, k, v, None, scale, None, 0.0, True)
    assert probs_c.dtype == torch.float32 and out_c.dtype == torch.bfloat16
    torch.testing.assert_close(probs_c.sum(-1), torch.full((2, H, L), 1.003), rtol=0, atol=1e-6)
    # In float32 the output is exactly 1.003 x the C = 1 output; check that survived the core.
    ratio = (out_c.float() / out_1.float())[out_1.float().abs() > 0.1]
    torch.testing.assert_close(ratio.mean(), torch.tensor(1.003), rtol=0, atol=1e-3)


def test_gradient_reaches_the_scale():
    attn = _attention()
    x = torch.randn(2, L, D)
    scale = torch.ones(1, H, L, L, requires_grad=True)
    attn(x, attn_scale=scale).square().sum().backward()
    assert scale.grad is not None and scale.grad.abs().sum() > 0

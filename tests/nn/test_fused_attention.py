"""Fused Triton URPE attention against a float64 eager reference, forward and backward.

The kernel tests (``test_kernel_*``) run on the GPU where there is one. Without one they run under
Triton's CPU interpreter, which must be switched on (``TRITON_INTERPRET=1``) before triton is first
imported: :func:`test_kernels_under_cpu_interpreter` reruns them in a pytest subprocess with that
variable, so it never leaks into the other tests. Shapes are tiny because the interpreter executes
every tile op in numpy.
"""
from __future__ import annotations

import math

import pytest
import torch

from graphormer_urpe.nn import fused_attention
from graphormer_urpe.nn.attention import ATTENTION_IMPLS, URPEAttention, attention_kernel, eager_attention

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
KERNELS_RUN_HERE = ON_CUDA or fused_attention.TRITON_INTERPRETED
#: Tests of what a CPU does without the kernels: under Triton's interpreter "triton" runs them.
eager_on_cpu = pytest.mark.skipif(fused_attention.TRITON_INTERPRETED,
                                  reason="under Triton's interpreter the kernels run on CPU tensors")


def triton_impl(q, k, v, attn_bias=None, attn_scale=None, key_padding_mask=None, dropout_p=0.0):
    """The output of ``URPEAttention(attention_impl="triton")``'s kernel (no weights asked)."""
    out, weights = attention_kernel("triton")(q, k, v, attn_bias, attn_scale, key_padding_mask, dropout_p, False)
    assert weights is None
    return out


@pytest.fixture
def fused():
    """The module whose kernels run in this process (GPU, or the CPU interpreter)."""
    pytest.importorskip("triton")
    if not KERNELS_RUN_HERE:
        pytest.skip("no GPU: run by test_kernels_under_cpu_interpreter in a subprocess")
    return fused_attention


def test_kernels_under_cpu_interpreter(under_triton_interpreter):
    """Every ``test_kernel_*`` below, where Triton's interpreter runs the kernels on a CPU."""
    under_triton_interpreter(__file__, "test_kernel_", passed=12)


def _reference(q, k, v, attn_bias=None, attn_scale=None, key_padding_mask=None):
    """URPE attention in plain torch ops, in the inputs' dtype (float64 here): the oracle."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if attn_bias is not None:
        scores = scores + attn_bias
    if key_padding_mask is not None:
        scores = scores.masked_fill(key_padding_mask[:, None, None, :], -math.inf)
    probs = torch.softmax(scores, dim=-1)
    return (probs if attn_scale is None else probs * attn_scale) @ v


def _inputs(batch, heads, len_q, len_k, head_dim, bias_shape, scale_shape, padded, seed=0):
    """Random float64 q, k, v, B, C and a padding mask that leaves every row some keys."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, len_q, head_dim, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(batch, heads, len_k, head_dim, generator=gen, dtype=torch.float64) for _ in range(2))
    bias = None if bias_shape is None else 2 * torch.randn(*bias_shape, generator=gen, dtype=torch.float64)
    # URPE's C starts at 1 and stays near it; a wider range still exercises the gradient.
    scale = None if scale_shape is None else 0.5 + torch.rand(*scale_shape, generator=gen, dtype=torch.float64)
    mask = None
    if padded:
        lengths = torch.randint(1, len_k + 1, (batch,), generator=gen)
        lengths[0] = len_k
        mask = torch.arange(len_k)[None, :] >= lengths[:, None]
    return (q, k, v, bias, scale), mask


def _out_and_grads(fn, tensors, mask, grad_out):
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*leaves, key_padding_mask=mask)
    present = [t for t in leaves if t is not None]
    grads = torch.autograd.grad(out, present, grad_out)
    return [out, *grads]


def _max_err(result, reference):
    return (result.double().cpu() - reference).abs().max().item()


SHAPE_CASES = {
    # name: (B, H, Lq, Lk, d, bias shape, scale shape, padded)
    "graph_padded": (2, 2, 21, 21, 8, "BH", "BH", True),  # L not a multiple of the 16-wide tiles
    "broadcast_tables": (2, 3, 17, 17, 16, "1H", "B1", True),
    "sequence_tables": (3, 2, 19, 19, 8, "1H", "1H", False),  # [1, H, L, L] as the sequence model
    "bias_only": (1, 2, 33, 33, 4, "BH", None, True),  # three key tiles, d padded to 16
    "no_tables": (2, 1, 9, 9, 8, None, None, True),
    "cross_lengths": (2, 2, 7, 20, 8, "BH", "11", True),
}


def _table_shape(kind, batch, heads, len_q, len_k):
    if kind is None:
        return None
    return ({"B": batch, "1": 1}[kind[0]], {"H": heads, "1": 1}[kind[1]], len_q, len_k)


@pytest.mark.parametrize("case", SHAPE_CASES, ids=list(SHAPE_CASES))
def test_kernel_matches_float64_reference_fp32(fused, case):
    batch, heads, len_q, len_k, head_dim, bias_kind, scale_kind, padded = SHAPE_CASES[case]
    tensors, mask = _inputs(
        batch, heads, len_q, len_k, head_dim,
        _table_shape(bias_kind, batch, heads, len_q, len_k),
        _table_shape(scale_kind, batch, heads, len_q, len_k), padded,
    )
    grad_out = torch.randn(batch, heads, len_q, head_dim, dtype=torch.float64)
    expected = _out_and_grads(_reference, tensors, mask, grad_out)
    on_device = [None if t is None else t.float().to(DEVICE) for t in tensors]
    got = _out_and_grads(
        fused.fused_urpe_attention, on_device, None if mask is None else mask.to(DEVICE),
        grad_out.float().to(DEVICE),
    )
    names = ["out", "dq", "dk", "dv"] + ["dB"] * (bias_kind is not None) + ["dC"] * (scale_kind is not None)
    assert len(got) == len(expected) == len(names)
    for name, result, reference in zip(names, got, expected):
        assert result.shape == reference.shape, name
        assert result.dtype == torch.float32, name
        tolerance = 2e-5 * (1 + reference.abs().max().item())
        assert _max_err(result, reference) < tolerance, name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_kernel_low_precision_as_accurate_as_float32_core(fused, dtype):
    """16-bit q, k, v, B, C: errors (against float64 on the same rounded inputs) stay within one
    unit of the dtype's precision of the largest value, the bar the float32-core eager path sets."""
    tensors, mask = _inputs(2, 2, 33, 33, 8, (2, 2, 33, 33), (1, 2, 33, 33), padded=True, seed=1)
    tensors = [t.to(dtype) for t in tensors]
    grad_out = torch.randn(2, 2, 33, 8, dtype=torch.float64).to(dtype)
    expected = _out_and_grads(_reference, [t.double() for t in tensors], mask, grad_out.double())
    got = _out_and_grads(
        fused.fused_urpe_attention, [t.to(DEVICE) for t in tensors], mask.to(DEVICE), grad_out.to(DEVICE)
    )
    eps = torch.finfo(dtype).eps
    for name, result, reference in zip(["out", "dq", "dk", "dv", "dB", "dC"], got, expected):
        assert result.dtype == dtype, name
        assert _max_err(result, reference) < eps * reference.abs().max().item(), name


def test_kernel_mixed_dtypes_and_strided_inputs(fused):
    """As URPEAttention calls it: q, k, v strided views of one packed projection, tables in
    float32 while q, k, v are bf16 (autocast); the output is a [B, L, H, d]-major view."""
    batch, heads, length, head_dim = 2, 2, 18, 8
    gen = torch.Generator().manual_seed(2)
    packed = torch.randn(batch, length, 3, heads, head_dim, generator=gen).to(torch.bfloat16)
    q, k, v = packed.permute(2, 0, 3, 1, 4).unbind(0)
    bias = torch.randn(batch, heads, length, length, generator=gen)
    scale = 0.9 + 0.2 * torch.rand(1, heads, length, length, generator=gen)
    mask = torch.zeros(batch, length, dtype=torch.bool)
    mask[1, 11:] = True
    grad_out = torch.randn(batch, heads, length, head_dim, generator=gen).to(torch.bfloat16)
    expected = _out_and_grads(
        _reference, [t.double() for t in (q, k, v, bias, scale)], mask, grad_out.double()
    )
    got = _out_and_grads(
        fused.fused_urpe_attention, [t.to(DEVICE) for t in (q, k, v, bias, scale)], mask.to(DEVICE),
        grad_out.to(DEVICE),
    )
    assert got[0].transpose(1, 2).is_contiguous()
    # bf16 results are rounded to bf16; the float32 table gradients carry the ~16-bit precision
    # of P ⊙ C split into two bf16 MMA operands (one bf16 operand would give ~2^-8).
    tolerances = {torch.bfloat16: torch.finfo(torch.bfloat16).eps, torch.float32: 2.0 ** -14}
    dtypes = [torch.bfloat16] * 4 + [torch.float32] * 2
    for name, result, reference, dtype in zip(["out", "dq", "dk", "dv", "dB", "dC"], got, expected, dtypes):
        assert result.dtype == dtype, name
        assert _max_err(result, reference) < tolerances[dtype] * (1 + reference.abs().max().item()), name


def test_kernel_without_table_grads_and_all_padding_row(fused):
    """Tables that need no gradient get none; a batch element whose keys are all padding yields
    zeros (the eager softmax gives NaN) and finite gradients, leaving the other rows exact."""
    tensors, _ = _inputs(2, 2, 12, 12, 8, (2, 2, 12, 12), (2, 2, 12, 12), padded=False, seed=3)
    mask = torch.zeros(2, 12, dtype=torch.bool)
    mask[1] = True
    q, k, v, bias, scale = [t.float().to(DEVICE) for t in tensors]
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = fused.fused_urpe_attention(q, k, v, bias, scale, mask.to(DEVICE))
    out.sum().backward()
    assert bias.grad is None and scale.grad is None
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    for grad in (q.grad, k.grad, v.grad):
        assert torch.isfinite(grad).all()
        assert torch.equal(grad[1], torch.zeros_like(grad[1]))
    reference = _reference(*[t[:1].double() for t in tensors], mask[:1])
    assert _max_err(out[:1].detach(), reference) < 1e-5


def test_kernel_dropout_matches_eager_with_the_same_mask(fused):
    """Fused dropout equals eager attention whose C is multiplied by the kernels' own mask, forward
    and backward (so the backward regenerates the forward's mask), with a broadcast C."""
    batch, heads, length, dropout_p, seed = 2, 2, 21, 0.3, 1234
    tensors, mask = _inputs(batch, heads, length, length, 8, (batch, heads, length, length),
                            (1, heads, length, length), padded=True, seed=8)
    keep_scale = fused.dropout_keep_scale((batch, heads, length, length), dropout_p, seed, DEVICE).cpu()
    torch.testing.assert_close(keep_scale.unique(), torch.tensor([0.0, 1 / (1 - dropout_p)]))
    assert abs((keep_scale == 0).float().mean().item() - dropout_p) < 0.05
    other_seed = fused.dropout_keep_scale((batch, heads, length, length), dropout_p, seed + 1, DEVICE).cpu()
    assert not torch.equal(keep_scale, other_seed)

    grad_out = torch.randn(batch, heads, length, 8, dtype=torch.float64)

    def dropped_reference(q, k, v, bias, scale, key_padding_mask):
        return _reference(q, k, v, bias, scale * keep_scale.double(), key_padding_mask)

    def fused_dropout(*args, key_padding_mask):
        return fused.fused_urpe_attention(*args, key_padding_mask, dropout_p=dropout_p, seed=seed)

    expected = _out_and_grads(dropped_reference, tensors, mask, grad_out)
    got = _out_and_grads(fused_dropout, [t.float().to(DEVICE) for t in tensors], mask.to(DEVICE),
                         grad_out.float().to(DEVICE))
    for name, result, reference in zip(["out", "dq", "dk", "dv", "dB", "dC"], got, expected):
        assert _max_err(result, reference) < 2e-5 * (1 + reference.abs().max().item()), name


@pytest.mark.skipif(ON_CUDA, reason="on a GPU the kernel tests compile and run the kernels")
@pytest.mark.parametrize("dtype, head_dim", [(torch.bfloat16, 32), (torch.float32, 10)], ids=["bf16", "fp32"])
def test_kernels_compile_for_hopper_without_gpu(monkeypatch, tmp_path, dtype, head_dim):
    """Triton's real backend (TTIR -> PTX -> cubin by ptxas) compiles the three kernels for sm_90
    with every feature on (16-bit or float32 inputs, float32 tables, padding mask, dropout, table
    gradients) at their default tiles for that dtype and head width, launches captured instead of
    run: what the CPU interpreter cannot check."""
    triton = pytest.importorskip("triton")
    if fused_attention.TRITON_INTERPRETED:
        pytest.skip("TRITON_INTERPRET=1 was set for the whole session")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # the GPU default; silences a notice
    pointer_types = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.uint8: "*u8", torch.int64: "*i64"}
    compiled = {}

    def compile_launch(kernel, args, kwargs):
        options = {key: kwargs.pop(key) for key in ("num_warps", "num_stages")}
        values = {**dict(zip(kernel.arg_names, args)), **kwargs}
        constexpr_names = {kernel.arg_names[i] for i in kernel.constexprs}
        signature, constants = {}, {}
        for name, value in values.items():
            if name in constexpr_names or value is None:
                signature[name], constants[name] = "constexpr", value
            elif isinstance(value, torch.Tensor):
                signature[name] = pointer_types[value.dtype]
            else:
                signature[name] = "fp32" if isinstance(value, float) else "i32"
        binary = triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32),
                                options=options)
        compiled[kernel.__name__] = binary.asm["cubin"]

    for name in ("_urpe_fwd_kernel", "_urpe_bwd_dkdv_kernel", "_urpe_bwd_dq_kernel"):
        kernel = getattr(fused_attention, name)
        monkeypatch.setattr(fused_attention, name, type("Capture", (), {
            "__getitem__": lambda self, grid, kernel=kernel: lambda *a, **kw: compile_launch(kernel, a, dict(kw))
        })())
    q, k, v = (torch.randn(2, 2, 40, head_dim, dtype=dtype, requires_grad=True) for _ in range(3))
    bias, scale = (torch.randn(2, 2, 40, 40, requires_grad=True) for _ in range(2))
    mask = torch.zeros(2, 40, dtype=torch.bool)
    config = fused_attention._launch_config(head_dim, dtype)
    out = fused_attention._FusedURPEAttention.apply(q, k, v, bias, scale, mask, 0.1, torch.tensor([7]), config)
    out.float().sum().backward()
    assert sorted(compiled) == ["_urpe_bwd_dkdv_kernel", "_urpe_bwd_dq_kernel", "_urpe_fwd_kernel"]
    assert all(len(cubin) > 0 for cubin in compiled.values())


def test_backward_formulas_match_autograd():
    """The closed-form gradients the kernels implement (docs/fused_attention.md), in float64,
    against autograd through the eager reference; independent of triton."""
    (q, k, v, bias, scale), mask = _inputs(2, 2, 10, 10, 4, (2, 2, 10, 10), (2, 2, 10, 10), padded=True, seed=4)
    grad_out = torch.randn(2, 2, 10, 4, dtype=torch.float64)
    expected = _out_and_grads(_reference, (q, k, v, bias, scale), mask, grad_out)[1:]

    sm_scale = q.shape[-1] ** -0.5
    s = (q @ k.transpose(-1, -2) * sm_scale + bias).masked_fill(mask[:, None, None, :], -math.inf)
    p = torch.softmax(s, dim=-1)
    out = (p * scale) @ v
    do_vt = grad_out @ v.transpose(-1, -2)
    dp = scale * do_vt
    delta = (grad_out * out).sum(-1, keepdim=True)  # = rowsum(dp ⊙ p)
    torch.testing.assert_close(delta, (dp * p).sum(-1, keepdim=True))
    ds = p * (dp - delta)
    derived = [ds @ k * sm_scale, ds.transpose(-1, -2) @ q * sm_scale, (p * scale).transpose(-1, -2) @ grad_out,
               ds, p * do_vt]
    for result, reference in zip(derived, expected):
        torch.testing.assert_close(result, reference)


@eager_on_cpu
def test_the_triton_impl_is_the_eager_kernel_on_cpu():
    """attention_impl="triton" runs the eager kernel for CPU tensors (without Triton's
    interpreter), its dropout included; and for a call that asks for the weights anywhere."""
    tensors, mask = _inputs(2, 2, 6, 6, 4, (1, 2, 6, 6), (2, 2, 6, 6), padded=True, seed=5)
    q, k, v, bias, scale = [t.float() for t in tensors]
    expected, weights = eager_attention(q, k, v, bias, scale, mask, 0.0, True)
    assert torch.equal(triton_impl(q, k, v, bias, scale, mask), expected)
    out, got_weights = attention_kernel("triton")(q, k, v, bias, scale, mask, 0.0, True)
    assert torch.equal(out, expected) and torch.equal(got_weights, weights)
    torch.manual_seed(0)
    dropped = triton_impl(q, k, v, bias, scale, mask, dropout_p=0.5)
    torch.manual_seed(0)
    assert torch.equal(dropped, eager_attention(q, k, v, bias, scale, mask, 0.5, False)[0])
    assert not torch.equal(dropped, expected)
    assert torch.equal(triton_impl(q, k, v, bias, scale, mask, dropout_p=1.0), torch.zeros_like(expected))


def test_kernel_dropout_seed_is_drawn_on_the_device_without_a_host_read(fused):
    """With no seed given, the dropout seed is drawn on the tensors' device from torch's default
    generator and read by the kernels from device memory: no operator reads a value back to the
    host (what a CUDA graph needs, so each replay draws a new mask), ``torch.manual_seed``
    reproduces the output, and the next call draws another mask."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class NoHostReads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            assert func._overloadpacket.__name__ not in ("_local_scalar_dense", "item", "nonzero"), func
            return func(*args, **(kwargs or {}))

    tensors, mask = _inputs(2, 2, 16, 16, 8, (2, 2, 16, 16), (2, 2, 16, 16), padded=True, seed=10)
    q, k, v, bias, scale = [t.float().to(DEVICE) for t in tensors]
    outs = []
    for manual_seed in (0, 0, None):
        if manual_seed is not None:
            torch.manual_seed(manual_seed)
        with NoHostReads():
            outs.append(fused.fused_urpe_attention(q, k, v, bias, scale, mask.to(DEVICE), dropout_p=0.3))
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[1], outs[2])
    with pytest.raises(ValueError, match="seed must be one int64"):
        fused.fused_urpe_attention(q, k, v, bias, scale, mask.to(DEVICE), dropout_p=0.3,
                                   seed=torch.zeros(2, dtype=torch.int64, device=DEVICE))


@eager_on_cpu
def test_registered_as_attention_impl():
    """URPEAttention(attention_impl="triton") is the eager layer, bit for bit, where the fused
    kernels cannot run (CPU without Triton's interpreter), and hands need_weights to the eager
    kernel."""
    assert ATTENTION_IMPLS["triton"] is fused_attention.fused_attention_kernel
    torch.manual_seed(6)
    batch, length, heads, width = 2, 7, 2, 8
    eager_layer = URPEAttention(width, heads, dropout=0.1, attention_impl="eager").eval()
    fused_layer = URPEAttention(width, heads, dropout=0.1, attention_impl="triton").eval()
    fused_layer.load_state_dict(eager_layer.state_dict())
    x = torch.randn(batch, length, width)
    bias = torch.randn(batch, heads, length, length)
    scale = 1 + 0.1 * torch.randn(1, heads, length, length)
    mask = torch.zeros(batch, length, dtype=torch.bool)
    mask[1, 5:] = True
    out, probs = fused_layer(x, bias, scale, mask, need_weights=True)
    expected_out, expected_probs = eager_layer(x, bias, scale, mask, need_weights=True)
    assert torch.equal(out, expected_out) and torch.equal(probs, expected_probs)
    assert torch.equal(fused_layer(x, bias, scale, mask), expected_out)


def test_bad_input_raises_value_error():
    pytest.importorskip("triton")
    q = torch.randn(2, 2, 5, 4)
    with pytest.raises(ValueError, match="attention_impl"):
        attention_kernel("flash")
    fused_urpe = fused_attention.fused_urpe_attention
    with pytest.raises(ValueError, match="attn_bias"):
        fused_urpe(q, q, q, attn_bias=torch.randn(2, 2, 5, 4))
    with pytest.raises(ValueError, match="attn_scale"):
        fused_urpe(q, q, q, attn_scale=torch.randn(3, 2, 5, 5))
    with pytest.raises(ValueError, match="key_padding_mask"):
        fused_urpe(q, q, q, key_padding_mask=torch.zeros(2, 5))
    with pytest.raises(ValueError, match="dtype"):
        fused_urpe(q, q, q.double())
    with pytest.raises(ValueError, match="\\[B, H, L, d\\]"):
        fused_urpe(q[0], q[0], q[0])


@pytest.mark.skipif(ON_CUDA, reason="checks the CPU refusal of the compiled kernels")
def test_the_fused_kernels_refuse_cpu_tensors_when_compiled():
    pytest.importorskip("triton")
    if fused_attention.TRITON_INTERPRETED:
        pytest.skip("TRITON_INTERPRET=1 was set for the whole session")
    q = torch.randn(1, 1, 4, 4)
    with pytest.raises(ValueError, match="CUDA"):
        fused_attention.fused_urpe_attention(q, q, q)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_graph_sized_batch(dtype):
    """Graph-model sizes (PCQM4Mv2: up to ~50 nodes + graph token; d = 32) with the production
    64x64 tiles, against float64 on the same rounded inputs; attention_impl="triton" picks the kernel."""
    batch, heads, length, head_dim = 8, 8, 131, 32
    tensors, mask = _inputs(batch, heads, length, length, head_dim, (batch, heads, length, length),
                            (batch, heads, length, length), padded=True, seed=7)
    tensors = [t.to(dtype) for t in tensors]
    grad_out = torch.randn(batch, heads, length, head_dim, dtype=torch.float64).to(dtype)
    expected = _out_and_grads(_reference, [t.double() for t in tensors], mask, grad_out.double())
    got = _out_and_grads(triton_impl,
                         [t.cuda() for t in tensors], mask.cuda(), grad_out.cuda())
    eps = torch.finfo(dtype).eps if dtype != torch.float32 else 1e-5
    for name, result, reference in zip(["out", "dq", "dk", "dv", "dB", "dC"], got, expected):
        assert _max_err(result, reference) < eps * (1 + reference.abs().max().item()), name


@pytest.mark.gpu
def test_gpu_auto_uses_fused_dropout_in_training():
    """attention_impl="triton" in training takes the fused path, dropout included: its result is
    the fused kernel's for the seed drawn from torch's generator, not the eager one's."""
    tensors, mask = _inputs(2, 4, 40, 40, 16, (2, 4, 40, 40), (2, 4, 40, 40), padded=True, seed=9)
    q, k, v, bias, scale = [t.float().cuda() for t in tensors]
    torch.manual_seed(0)
    auto = triton_impl(q, k, v, bias, scale, mask.cuda(), dropout_p=0.2)
    torch.manual_seed(0)
    fused_run = fused_attention.fused_urpe_attention(q, k, v, bias, scale, mask.cuda(), dropout_p=0.2)
    assert torch.equal(auto, fused_run)
    evaluation = triton_impl(q, k, v, bias, scale, mask.cuda())
    assert not torch.equal(auto, evaluation)

"""The CPU dropout: F.dropout's distribution (p to 2^-16) and gradient, with a cheaper mask."""
from __future__ import annotations

import pytest
import torch

from graphormer_urpe.nn.dropout import Dropout, dropout


def test_keeps_each_element_with_probability_one_minus_p_and_rescales():
    torch.manual_seed(0)
    x = torch.ones(1000, 1000, requires_grad=True)
    out = dropout(x, 0.1)
    kept = out != 0
    # 1e6 Bernoulli(0.9) draws: the kept fraction's std is 3e-4.
    assert abs(kept.float().mean().item() - 0.9) < 2e-3
    keep = 1 - round(0.1 * 65536) / 65536  # p to a multiple of 2^-16: 0.100006
    torch.testing.assert_close(out[kept], torch.full((int(kept.sum()),), 1 / keep))
    out.backward(torch.full_like(out, 2.0))  # the gradient is the same mask and scale
    torch.testing.assert_close(x.grad, 2.0 * out.detach())
    # Independent masks: a second call keeps other elements.
    assert (dropout(x, 0.1) != 0).ne(kept).any()


def test_identity_when_off_and_the_edge_cases_of_f_dropout():
    x = torch.randn(5, 7)
    assert dropout(x, 0.1, training=False) is x and dropout(x, 0.0) is x
    assert torch.equal(dropout(x, 1.0), torch.zeros_like(x))
    with pytest.raises(ValueError, match="dropout probability"):
        dropout(x, 1.5)
    module = Dropout(0.25)
    assert module.p == 0.25 and torch.equal(module.eval()(x), x)
    assert (module.train()(torch.ones(100, 100)) == 0).any()


@pytest.mark.parametrize("p", [0.1, 0.5, 1e-4])
def test_any_shape_and_the_mean_is_kept(p):
    """Odd sizes (four 16-bit draws per random number, the tail cut off), masks independent of
    position (each quarter of a draw kept as often), and E[dropout(x)] = x to sampling noise."""
    torch.manual_seed(1)
    for shape in [(1,), (3,), (5, 7), (2, 3, 4, 5)]:
        assert dropout(torch.ones(shape), p).shape == shape
    x = torch.ones(4_000_000)
    out = dropout(x, p)
    kept = (out != 0).float().view(-1, 4)
    expected = 1 - round(p * 65536) / 65536
    noise = 5 * (expected * (1 - expected) / 1_000_000) ** 0.5 + 1e-6
    assert (kept.mean(0) - expected).abs().max() < noise  # each of the four 16-bit lanes
    assert abs(out.mean().item() - 1.0) < 5 * (p / (1 - p) / 4_000_000) ** 0.5 + 1e-6

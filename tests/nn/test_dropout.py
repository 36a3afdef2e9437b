"""The CPU dropout: F.dropout's distribution and gradient, with a mask drawn by uniform_."""
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
    torch.testing.assert_close(out[kept], torch.full((int(kept.sum()),), 1 / 0.9))
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

import pytest
import torch

from graphormer_urpe.training.schedule import polynomial_decay_factor, warmup_polynomial_decay


def _lrs(steps, **kw):
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=2e-4)
    sched = warmup_polynomial_decay(opt, **kw)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_warmup_is_linear_then_decays_to_end_lr():
    lrs = _lrs(130, warmup_steps=10, total_steps=110, end_lr=1e-9, power=1.0)
    assert lrs[0] == 0.0
    assert lrs[5] == pytest.approx(1e-4)
    assert lrs[10] == pytest.approx(2e-4)
    # halfway through the decay: (lr - end) / 2 + end
    assert lrs[60] == pytest.approx((2e-4 - 1e-9) / 2 + 1e-9)
    assert lrs[110] == pytest.approx(1e-9)
    assert lrs[129] == pytest.approx(1e-9)
    decay = lrs[10:111]
    assert all(a > b for a, b in zip(decay, decay[1:]))


def test_power_shapes_the_decay():
    half = polynomial_decay_factor(60, 10, 110, 2e-4, 0.0, power=2.0)
    assert half == pytest.approx(0.25)


def test_rejects_total_not_after_warmup():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ValueError, match="total_steps"):
        warmup_polynomial_decay(opt, warmup_steps=100, total_steps=100, end_lr=0.0)

import pytest
import torch

from graphormer_urpe.training.schedule import (polynomial_decay_factor, polynomial_decay_lr,
                                               warmup_polynomial_decay)


def _lrs(steps, **kw):
    """The lr each of ``steps`` optimizer steps uses (read before the step, as AdamW does)."""
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=2e-4)
    sched = warmup_polynomial_decay(opt, **kw)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def fairseq_polynomial_decay(num_updates, warmup, total, lr, end_lr, power):
    """The reference: Graphormer v1's ``PolynomialDecayLR.get_lr`` / fairseq's
    ``PolynomialDecayLRSchedule``, restated, for update number ``num_updates`` (1 = the first)."""
    if warmup > 0 and num_updates <= warmup:
        return num_updates / float(warmup) * lr
    if num_updates >= total:
        return end_lr
    pct_remaining = 1 - (num_updates - warmup) / (total - warmup)
    return (lr - end_lr) * pct_remaining ** power + end_lr


@pytest.mark.parametrize("power", [1.0, 2.0])
def test_every_update_uses_the_fairseq_lr_of_its_update_number(power):
    """Step k (0-based) is update number k + 1: the first update already uses lr / warmup."""
    lrs = _lrs(130, warmup_steps=10, total_steps=110, end_lr=1e-9, power=power)
    expected = [fairseq_polynomial_decay(k + 1, 10, 110, 2e-4, 1e-9, power) for k in range(130)]
    assert lrs == pytest.approx(expected, rel=1e-12, abs=1e-20)
    assert lrs[0] == pytest.approx(2e-4 / 10)


def test_warmup_is_linear_then_decays_to_end_lr():
    lrs = _lrs(130, warmup_steps=10, total_steps=110, end_lr=1e-9, power=1.0)
    assert lrs[4] == pytest.approx(1e-4)  # update 5 of 10
    assert lrs[9] == pytest.approx(2e-4)  # update 10: the peak
    # update 60, halfway through the decay: (lr - end) / 2 + end
    assert lrs[59] == pytest.approx((2e-4 - 1e-9) / 2 + 1e-9)
    assert lrs[109] == pytest.approx(1e-9)
    assert lrs[129] == pytest.approx(1e-9)
    decay = lrs[9:110]
    assert all(a > b for a, b in zip(decay, decay[1:]))


def test_device_formula_is_the_host_schedule():
    """The tensor formula (what the training engine evaluates on its device) gives the host
    ``LambdaLR``'s values for a whole range of updates at once, bit for bit in float64."""
    lrs = _lrs(130, warmup_steps=10, total_steps=110, end_lr=1e-9, power=1.0)
    updates = torch.arange(1, 131, dtype=torch.float64)
    on_device = polynomial_decay_lr(updates, 10, 110, 2e-4, 1e-9, 1.0)
    assert on_device.tolist() == lrs


def test_power_shapes_the_decay():
    half = polynomial_decay_factor(59, 10, 110, 2e-4, 0.0, power=2.0)  # update 60
    assert half == pytest.approx(0.25)


def test_no_warmup_starts_at_the_peak():
    assert polynomial_decay_factor(0, 0, 100, 2e-4, 0.0, power=1.0) == pytest.approx(0.99)


def test_rejects_total_not_after_warmup():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ValueError, match="total_steps"):
        warmup_polynomial_decay(opt, warmup_steps=100, total_steps=100, end_lr=0.0)

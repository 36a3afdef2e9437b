r"""Graphormer's learning-rate schedule: linear warmup, then polynomial decay.

.. math::
    \eta(t) = \begin{cases}
      \eta_0 \, t / T_w & t \le T_w \\
      (\eta_0 - \eta_{end}) \big(1 - \tfrac{t - T_w}{T - T_w}\big)^p + \eta_{end} & T_w < t \le T \\
      \eta_{end} & t > T
    \end{cases}

stepped once per optimizer step (fairseq's ``polynomial_decay`` as used by Graphormer).
"""
from __future__ import annotations

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


def polynomial_decay_factor(step: int, warmup_steps: int, total_steps: int, lr: float,
                            end_lr: float, power: float) -> float:
    """The multiplier ``eta(step) / lr`` of the schedule above."""
    if warmup_steps > 0 and step <= warmup_steps:
        return step / warmup_steps
    if step >= total_steps:
        return end_lr / lr
    remaining = 1.0 - (step - warmup_steps) / (total_steps - warmup_steps)
    return ((lr - end_lr) * remaining ** power + end_lr) / lr


def warmup_polynomial_decay(optimizer: Optimizer, warmup_steps: int, total_steps: int,
                            end_lr: float, power: float = 1.0) -> LambdaLR:
    """A per-step ``LambdaLR`` for every param group (all share the optimizer's base lr)."""
    if total_steps <= warmup_steps:
        raise ValueError(f"total_steps ({total_steps}) must exceed warmup_steps ({warmup_steps})")
    lr = optimizer.defaults["lr"]
    return LambdaLR(optimizer, lambda step: polynomial_decay_factor(
        step, warmup_steps, total_steps, lr, end_lr, power))

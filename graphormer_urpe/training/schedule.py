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


def check_schedule(lr: float, end_lr: float, warmup_steps: int, total_steps: int | None = None,
                   total_from: str = "") -> None:
    """One-line ``ValueError`` for a schedule that cannot run: ``lr`` must be positive (the
    schedule divides by it), ``end_lr`` in ``[0, lr]`` (it decays), ``warmup_steps >= 0`` and,
    when the length is known, below ``total_steps`` (``total_from`` says where that came from)."""
    if not lr > 0:
        raise ValueError(f"model.lr must be > 0, got {lr}")
    if not 0 <= end_lr <= lr:
        raise ValueError(f"model.end_lr must be between 0 and model.lr={lr} (the schedule decays "
                         f"to it), got {end_lr}")
    if warmup_steps < 0:
        raise ValueError(f"model.warmup_steps must be >= 0, got {warmup_steps}")
    if total_steps is not None and total_steps <= warmup_steps:
        raise ValueError(f"model.warmup_steps ({warmup_steps}) must be below the schedule's "
                         f"total_steps ({total_steps}{total_from}): lower model.warmup_steps")


def warmup_polynomial_decay(optimizer: Optimizer, warmup_steps: int, total_steps: int,
                            end_lr: float, power: float = 1.0) -> LambdaLR:
    """A per-step ``LambdaLR`` for every param group (all share the optimizer's base lr)."""
    lr = optimizer.defaults["lr"]
    check_schedule(lr, end_lr, warmup_steps, total_steps)
    return LambdaLR(optimizer, lambda step: polynomial_decay_factor(
        step, warmup_steps, total_steps, lr, end_lr, power))

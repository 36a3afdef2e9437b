r"""Graphormer's learning-rate schedule: linear warmup, then polynomial decay.

The learning rate of optimizer update number :math:`u = 1, 2, \dots` (the ``u``-th
``optimizer.step()``, so ``u = step + 1`` for a zero-based step counter such as
``trainer.global_step`` before the step) is

.. math::
    \eta(u) = \begin{cases}
      \eta_0 \, u / T_w & u \le T_w \\
      (\eta_0 - \eta_{end}) \big(1 - \tfrac{u - T_w}{T - T_w}\big)^p + \eta_{end} & T_w < u < T \\
      \eta_{end} & u \ge T
    \end{cases}

as in Graphormer v1's ``PolynomialDecayLR`` (``_step_count`` is ``u``) and fairseq's
``polynomial_decay``: the first update already uses :math:`\eta_0 / T_w`, not 0.
:func:`relative_lr` is the one implementation; the host ``LambdaLR`` and the training engine's
on-device learning rate (:func:`polynomial_decay_lr`, :mod:`.engine`) both use it.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


def relative_lr(update: Tensor, warmup_steps: int, total_steps: int, end_ratio: float,
                power: float) -> Tensor:
    r""":math:`\eta(u) / \eta_0` for update numbers ``update`` (a float tensor of any shape, on any
    device), with ``end_ratio`` :math:`= \eta_{end} / \eta_0`. Only elementwise tensor ops, so it
    runs inside a CUDA graph without a host sync."""
    warmup = update / warmup_steps if warmup_steps > 0 else torch.ones_like(update)
    remaining = (1.0 - (update - warmup_steps) / (total_steps - warmup_steps)).clamp(0.0, 1.0)
    decay = (1.0 - end_ratio) * remaining ** power + end_ratio
    return torch.where(update <= warmup_steps, warmup, decay)


def polynomial_decay_lr(update: Tensor, warmup_steps: int, total_steps: int, lr: float,
                        end_lr: float, power: float) -> Tensor:
    r""":math:`\eta(u)` above: ``lr`` times :func:`relative_lr`, the product ``LambdaLR`` forms
    (so in float64 the two are equal bit for bit)."""
    return lr * relative_lr(update, warmup_steps, total_steps, end_lr / lr, power)


def polynomial_decay_factor(step: int, warmup_steps: int, total_steps: int, lr: float,
                            end_lr: float, power: float) -> float:
    """``eta(step + 1) / lr``: the multiplier for zero-based optimizer step ``step`` (what
    ``LambdaLR`` passes), in float64."""
    update = torch.tensor(step + 1, dtype=torch.float64)
    return float(relative_lr(update, warmup_steps, total_steps, end_lr / lr, power))


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


def warmup_length(steps: int, fraction: float | None, total_steps: int | None) -> int:
    """The warmup: ``steps``, or ``fraction`` of ``total_steps`` when given (0 while the total
    is not known yet)."""
    if fraction is None:
        return steps
    if not 0 <= fraction < 1:
        raise ValueError(f"model.warmup_fraction must be in [0, 1), got {fraction}")
    return int(round(fraction * (total_steps or 0)))


def schedule_lengths(lr: float, end_lr: float, warmup_steps: int, warmup_fraction: float | None,
                     total_steps: int | None, budget: float | None = None,
                     budget_from: str = "the trainer") -> tuple[int, int | None]:
    """``(warmup, total)`` of a model's schedule, checked (:func:`check_schedule`): the total is
    ``total_steps`` when given, else the training's step ``budget`` (from ``budget_from``; None or
    infinite: not known yet, None); the warmup is :func:`warmup_length` of that total. The one
    place the CLI's early check and a run take their lengths from."""
    total = total_steps
    if total is None and budget is not None and math.isfinite(budget):
        total = int(budget)
    warmup = warmup_length(warmup_steps, warmup_fraction, total)
    check_schedule(lr, end_lr, warmup, total,
                   "" if total_steps is not None or total is None else f", from {budget_from}")
    return warmup, total


def warmup_polynomial_decay(optimizer: Optimizer, warmup_steps: int, total_steps: int,
                            end_lr: float, power: float = 1.0) -> LambdaLR:
    """A per-step ``LambdaLR`` for every param group (all share the optimizer's base lr)."""
    lr = optimizer.defaults["lr"]
    check_schedule(lr, end_lr, warmup_steps, total_steps)
    return LambdaLR(optimizer, lambda step: polynomial_decay_factor(
        step, warmup_steps, total_steps, lr, end_lr, power))

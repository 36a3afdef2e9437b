r"""Dropout whose mask is cheaper to draw on a CPU.

.. math::
    \mathrm{dropout}(x) = x \odot m / q, \qquad m_i = [u_i \ge d],\ u_i \sim U\{0, \dots, 2^{16} - 1\},
    \quad d = \mathrm{round}(2^{16} p),\ q = 1 - d / 2^{16}

the distribution of :func:`torch.nn.functional.dropout` with ``p`` rounded to a multiple of
``2^-16`` (0.1 -> 0.100006): each element is kept with probability ``q`` and scaled by ``1 / q``,
so the expectation is exact. On a CPU, PyTorch draws its mask with ``bernoulli_``, and even
``rand`` draws one 32-bit number per element from the Mersenne Twister; here each 64-bit draw
gives four 16-bit ``u``, so the attention's masks, a large part of a CPU training step, cost
less (docs/benchmarks.md). On accelerators and under
``torch.compile`` this is :func:`F.dropout` itself (fused kernels, RNG that CUDA graphs replay),
so the two paths draw different masks from nearly the same distribution.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


#: The profiler's name for the CPU mask path: one fused kernel on a GPU (``native_dropout``), so
#: operator counts that stand for GPU kernels count it once (``scripts/bench_train.py``).
CPU_DROPOUT = "graphormer_urpe::dropout"


#: Levels of the 16-bit uniform draw a CPU mask compares with (``p`` is rounded to 1 / this).
MASK_LEVELS = 1 << 16


def dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """``F.dropout(x, p, training)``; on a CPU the mask compares 16-bit uniform draws, four from
    each 64-bit random number (``p`` rounded to a multiple of ``2^-16``, the scale to match)."""
    if not training or p == 0.0:
        return x
    dropped = round(p * MASK_LEVELS) if 0.0 < p < 1.0 else 0
    if x.device.type != "cpu" or torch.compiler.is_compiling() or not 0 < dropped < MASK_LEVELS:
        return F.dropout(x, p, training)  # also p == 1 and the error for p outside [0, 1]
    with torch.profiler.record_function(CPU_DROPOUT):
        n = x.numel()
        draws = torch.randint(-(1 << 63), (1 << 63) - 1, ((n + 3) // 4,), dtype=torch.int64)
        keep = draws.view(torch.int16)[:n].view(x.shape) >= dropped - MASK_LEVELS // 2
        return x * keep.to(x.dtype).mul_(MASK_LEVELS / (MASK_LEVELS - dropped))


class Dropout(nn.Dropout):
    """:class:`torch.nn.Dropout` computed by :func:`dropout` (same parameters, same state)."""

    def forward(self, x: Tensor) -> Tensor:
        return dropout(x, self.p, self.training)

r"""Dropout whose mask is cheaper to draw on a CPU.

.. math::
    \mathrm{dropout}(x) = x \odot m / (1 - p), \qquad m_i = [u_i \ge p],\ u_i \sim U[0, 1)

the distribution of :func:`torch.nn.functional.dropout` (each element kept with probability
``1 - p``, to float32's resolution of ``u``). On a CPU, PyTorch draws that mask with
``bernoulli_``, which took ~2.5x as long as drawing ``u`` with ``uniform_`` and comparing
(Graphormer-slim at batch 64: ~100 ms of a ~700 ms training step went to ``bernoulli_``). On
accelerators and under ``torch.compile`` this is :func:`F.dropout` itself (fused kernels, RNG
that CUDA graphs replay), so the two paths draw different masks from the same distribution.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


#: The profiler's name for the CPU mask path: one fused kernel on a GPU (``native_dropout``), so
#: operator counts that stand for GPU kernels count it once (``scripts/bench_train.py``).
CPU_DROPOUT = "graphormer_urpe::dropout"


def dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """``F.dropout(x, p, training)``, with the mask drawn by ``uniform_`` on a CPU."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu" or torch.compiler.is_compiling() or not 0.0 < p < 1.0:
        return F.dropout(x, p, training)  # also p == 1 and the error for p outside [0, 1]
    with torch.profiler.record_function(CPU_DROPOUT):
        keep = torch.rand(x.shape, dtype=torch.float32, device=x.device) >= p
        return x * keep.to(x.dtype).mul_(1.0 / (1.0 - p))


class Dropout(nn.Dropout):
    """:class:`torch.nn.Dropout` computed by :func:`dropout` (same parameters, same state)."""

    def forward(self, x: Tensor) -> Tensor:
        return dropout(x, self.p, self.training)

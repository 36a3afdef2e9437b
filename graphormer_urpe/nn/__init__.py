"""Neural-network modules: URPE attention, Graphormer encodings and backbones."""

from graphormer_urpe.nn.attention import URPEAttention

__all__ = ["URPEAttention"]
from graphormer_urpe.nn.graphormer import PRESETS, Graphormer, count_parameters

__all__ += ["Graphormer", "PRESETS", "count_parameters"]

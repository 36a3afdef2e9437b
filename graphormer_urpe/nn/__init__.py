"""Neural-network modules: URPE attention, Graphormer encodings and backbones."""

from graphormer_urpe.nn.attention import URPEAttention

__all__ = ["URPEAttention"]

"""Neural-network modules: URPE attention, Graphormer encodings and backbones, the sequence model."""

from graphormer_urpe.nn.attention import ATTENTION_IMPLS, URPEAttention, attention_kernel
from graphormer_urpe.nn.graphormer import PRESETS, Graphormer, GraphormerConfig, count_parameters
from graphormer_urpe.nn.sequence import POSITION_SCHEMES, SequenceTransformer

__all__ = ["ATTENTION_IMPLS", "URPEAttention", "attention_kernel", "Graphormer", "GraphormerConfig", "PRESETS",
           "count_parameters", "POSITION_SCHEMES", "SequenceTransformer"]

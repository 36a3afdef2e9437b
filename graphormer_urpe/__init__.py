"""Graphormer with URPE attention (Luo et al., NeurIPS 2022)."""

__version__ = "0.1.0"

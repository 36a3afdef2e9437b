"""Graphormer with URPE attention (Luo et al., NeurIPS 2022)."""
import os

# ogb checks PyPI for a newer release from a thread at import time; offline that only prints
# warnings, and no run should depend on the network. Users can still set it to 0.
os.environ.setdefault("OUTDATED_IGNORE", "1")

__version__ = "0.1.0"

"""The model imports and builds without the compiled graph encoder (``graphormer_urpe.data._encoding``):
only encoding graphs needs it, and then a missing extension is one line saying how to build it."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

#: Run in a fresh interpreter where the extension cannot be found, as in a tree never built.
CHILD = r'''
import sys

class NotBuilt:
    def find_spec(self, name, path=None, target=None):
        if name == "graphormer_urpe.data._encoding":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, NotBuilt())

import numpy as np
from graphormer_urpe.data.facts import DataFacts
from graphormer_urpe.nn.graphormer import Graphormer, GraphormerConfig
import graphormer_urpe.prediction.model  # noqa: F401  (prediction's model, too)

model = Graphormer(GraphormerConfig(), DataFacts(num_atom_embeddings=29, num_bond_embeddings=5))
print("parameters", sum(p.numel() for p in model.parameters()))
assert "graphormer_urpe.data._encoding" not in sys.modules

from graphormer_urpe.data import algos
try:
    algos.shortest_paths(2, np.array([[0, 1], [1, 0]]), max_hops=1)
except ImportError as error:
    print("error", error)
'''


def test_the_model_builds_without_the_extension():
    done = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("parameters ") and int(lines[0].split()[1]) > 0
    error = [line for line in lines if line.startswith("error ")]
    assert len(error) == 1 and len(lines) == 2, done.stdout  # the error is one line
    assert "graphormer_urpe.data._encoding" in error[0] and "pip install -e ." in error[0] and "make env" in error[0]

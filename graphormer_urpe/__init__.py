"""Graphormer with URPE attention (Luo et al., NeurIPS 2022).

From Python (``docs/python.md``): :func:`load` a trained model and :meth:`Model.predict`,
:meth:`Model.embed` SMILES; :func:`train` one from a DataFrame or a CSV; scikit-learn's
:class:`GraphormerRegressor`, :class:`GraphormerClassifier` and :class:`GraphormerEmbedder` (the fast
mode: fixed vectors for any head). They load on first use, so
``import graphormer_urpe`` imports neither torch nor Lightning.
"""
import importlib
import os

# ogb checks PyPI for a newer release from a thread at import time; offline that only prints
# warnings, and no run should depend on the network. Users can still set it to 0.
os.environ.setdefault("OUTDATED_IGNORE", "1")

__version__ = "0.1.0"

#: The Python API: ``{name: the module that defines it}``.
_LAZY = {"load": "api", "train": "api", "Model": "api", "Run": "api",
         "GraphormerRegressor": "estimators", "GraphormerClassifier": "estimators",
         "GraphormerEmbedder": "estimators"}

__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"graphormer_urpe.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})

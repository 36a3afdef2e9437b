"""Datasets, the array store and the encoding cache on it, collation and DataModules.

The DataModules (and everything that imports Lightning, PyG or RDKit) load on first access, so
``import graphormer_urpe.data`` stays cheap.
"""
from __future__ import annotations

import importlib

from graphormer_urpe.data.batch import GraphBatch

_LAZY = {
    "GraphDataModule": "datamodule",
    "ZINCDataModule": "zinc",
    "OGBLSCDataModule": "ogb_lsc",
    "PCQM4MDataModule": "ogb_lsc",
    "PCQM4Mv2DataModule": "ogb_lsc",
    "CSVDataModule": "property_csv",
    "SMILESTableDataModule": "datamodule",
    "DescriptorDataModule": "descriptors",
    "EncodedGraphDataset": "dataset",
    "SeededShuffleSampler": "dataset",
    "FlatGraphs": "collate",
    "ENCODINGS": "encodings",
    "EncodingParams": "encodings",
    "collate_pyg_graphs": "encode",
    "featurizer_spec": "featurize",
    "num_embeddings": "feature_ids",
}

__all__ = ["GraphBatch", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"graphormer_urpe.data.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

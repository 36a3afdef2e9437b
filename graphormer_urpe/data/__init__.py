"""Molecules -> features -> structural encodings (cached) -> padded batches, and the data sets.

The DataModules (and everything that imports Lightning, PyG or RDKit) load on first access, so
``import graphormer_urpe.data`` stays cheap; adding a data set, an encoding or a featurizer:
docs/data.md."""
from __future__ import annotations

import importlib

_LAZY = {
    "GraphBatch": "batch",
    "GraphDataModule": "datamodule",
    "ZINCDataModule": "zinc",
    "OGBLSCDataModule": "ogb_lsc",
    "PCQM4MDataModule": "ogb_lsc",
    "PCQM4Mv2DataModule": "ogb_lsc",
    "CSVDataModule": "property_csv",
    "SMILESTableDataModule": "datamodule",
    "DescriptorDataModule": "descriptor_pretraining",
    "EncodedGraphDataset": "dataset",
    "SeededShuffleSampler": "dataset",
    "FlatGraphs": "graphs",
    "ENCODINGS": "encodings",
    "EncodingParams": "encodings",
    "collate_pyg_graphs": "batch",
    "featurizer_spec": "featurize",
    "num_embeddings": "feature_ids",
}

__all__ = [*_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"graphormer_urpe.data.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

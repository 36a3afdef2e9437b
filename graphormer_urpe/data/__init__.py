"""Molecules -> features -> structural encodings (cached) -> padded batches, and the data sets.

A new data set is a module of its own beside :mod:`.zinc`, :mod:`.ogb_lsc`, :mod:`.property_csv`
and :mod:`.descriptor_pretraining`, holding its DataModule (a subclass of
:class:`~.datamodule.SMILESTableDataModule` for a SMILES table, else of
:class:`~.datamodule.GraphDataModule`), named in ``_LAZY`` below so that configs reach it as
``graphormer_urpe.data.<Class>``; a new encoding is a spec, an encoder and a parameter in
:mod:`.encodings` and an init argument of the same name on the GraphDataModule (its cache,
collation and the model follow it by name); a new featurizer is a
:class:`~.featurize.FeaturizerSpec` in ``FEATURIZERS`` of :mod:`.featurize`. The DataModules
(and everything that imports Lightning, PyG or RDKit) load on first access, so
``import graphormer_urpe.data`` stays cheap.
"""
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

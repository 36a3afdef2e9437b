"""Molecule property CSVs: ESOL regression, random/scaffold splits, rejected rows, bad input."""
from __future__ import annotations

import os

import numpy as np
import pandas as pd
import pytest

from graphormer_urpe.data.property_csv import murcko_scaffold
from graphormer_urpe.data import CSVDataModule

ESOL_TARGET = "measured log solubility in mols per litre"


@pytest.fixture(scope="module")
def esol(esol_csv):
    return esol_csv


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    return tmp_path_factory.mktemp("csv-cache")


@pytest.mark.parametrize("split", ["random", "scaffold"])
def test_esol_splits_cover_every_molecule_once(esol, cache_root, split):
    dm = CSVDataModule(path=str(esol), target_columns=[ESOL_TARGET], split=split, cache_root=str(cache_root),
                       build_workers=2, eval_batch_size=2000)
    assert (dm.num_targets, dm.task, dm.featurizer, dm.num_atom_embeddings) == (1, "regression", "ogb", 175)
    dm.prepare_data()
    dm.setup("fit")
    dm.setup("test")
    table = pd.read_csv(esol)
    graphs, graph_of_row, y, splits = dm.store()
    assert sorted(np.concatenate(list(splits.values())).tolist()) == list(range(len(table)))
    if split == "random":
        assert [len(splits[s]) for s in ("train", "val", "test")] == [902, 113, 113]
    batch = next(iter(dm.test_dataloader()))
    np.testing.assert_allclose(batch.y[:, 0].numpy(), table[ESOL_TARGET].to_numpy()[splits["test"]], rtol=1e-6)
    if split == "scaffold":
        scaffolds = {name: {murcko_scaffold(table["smiles"][r]) for r in rows} for name, rows in splits.items()}
        assert not scaffolds["train"] & scaffolds["val"] and not scaffolds["train"] & scaffolds["test"]
        assert not scaffolds["val"] & scaffolds["test"]
        assert 0.75 * len(table) <= len(splits["train"]) <= 0.8 * len(table)


def test_random_split_depends_on_the_split_seed_not_the_training_seed(esol, cache_root):
    """Runs with other training seeds (an ensemble, an ablation) share one test set."""
    def test_rows(seed=0, split_seed=0):
        return CSVDataModule(path=str(esol), target_columns=[ESOL_TARGET], cache_root=str(cache_root),
                             seed=seed, split_seed=split_seed).store()[3]["test"]

    assert np.array_equal(test_rows(), test_rows(seed=1))
    assert not np.array_equal(test_rows(), test_rows(split_seed=1))
    with pytest.raises(ValueError, match="split_seed"):
        test_rows(split_seed=-1)


def test_rejected_smiles_skipped_with_one_warning(tmp_path):
    path = tmp_path / "mixed.csv"
    pd.DataFrame({"smiles": ["CCO", "C1CC", "c1ccccc1", "not a smiles", "", "CC(=O)O", "CCN"],
                  "y1": [1, 2, 3, 4, 5, 6, 7], "y2": [0, 1, 0, 1, 1, None, 1]}).to_csv(path, index=False)
    dm = CSVDataModule(path=str(path), task="classification", split_fractions=(0.6, 0.2, 0.2),
                       cache_root=str(tmp_path / "cache"), target_columns=["y2"])
    with pytest.warns(UserWarning, match=r"skipped 3 of 7 rows .*\(lines 3, 5, 6\)") as record:
        dm.prepare_data()
    assert len(record) == 1
    graphs, graph_of_row, y, splits = dm.store()
    assert (graph_of_row < 0).nonzero()[0].tolist() == [1, 3, 4]
    served = np.concatenate([dm.load_split(s).graph_ids for s in splits])
    assert sorted(served.tolist()) == [0, 1, 2, 3]  # the 4 accepted molecules, each once
    assert dm.num_targets == 1 and dm.task == "classification"
    assert np.isnan(y[5, 0])  # an empty label is unknown, not 0
    two = CSVDataModule(path=str(path), cache_root=str(tmp_path / "cache"), target_columns=["y1", "y2"])
    assert two.num_targets == 2


def test_bad_files_are_value_errors_naming_them(tmp_path):
    bad = tmp_path / "bad.csv"
    pd.DataFrame({"smiles": ["xx", "C1CC"], "y": [1.0, 2.0]}).to_csv(bad, index=False)
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="bad.csv: no row"):
        CSVDataModule(path=str(bad), cache_root=str(tmp_path / "c")).prepare_data()
    with pytest.raises(ValueError, match="no target column.*'z'"):
        CSVDataModule(path=str(bad), target_columns=["z"])
    with pytest.raises(ValueError, match="no SMILES column 'mol'"):
        CSVDataModule(path=str(bad), smiles_column="mol")
    with pytest.raises(ValueError, match="does not exist"):
        CSVDataModule(path=str(tmp_path / "absent.csv"))
    labels = tmp_path / "labels.csv"
    pd.DataFrame({"smiles": ["CCO", "CCC"], "y": [0.5, 1.0]}).to_csv(labels, index=False)
    with pytest.raises(ValueError, match="classification targets must be 0, 1"):
        CSVDataModule(path=str(labels), task="classification", cache_root=str(tmp_path / "c")).prepare_data()
    with pytest.raises(ValueError, match="split_fractions"):
        CSVDataModule(path=str(labels), split_fractions=(0.5, 0.5, 0.5))


def test_a_fit_reads_and_hashes_the_file_once(esol, tmp_path, monkeypatch):
    """Building, setting up every split, the descriptors, the scaffold split and the predict
    split's SMILES open the CSV once, parse its table once and hash it once, also when the labels
    are read up front."""
    import builtins
    import io

    from graphormer_urpe.data import property_csv

    calls = {"open": 0, "read": 0, "hash": 0}
    read, digest, real_open = property_csv.read_property_csv, property_csv.file_fingerprint, io.open

    def counted(name, function):
        def call(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)
        return call

    def counted_open(file, *args, **kwargs):  # builtins.open and pathlib's io.open
        if isinstance(file, (str, os.PathLike)) and os.path.realpath(file) == os.path.realpath(labels):
            calls["open"] += 1
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(property_csv, "read_property_csv", counted("read", read))
    monkeypatch.setattr(property_csv, "file_fingerprint", counted("hash", digest))
    labels = tmp_path / "labels.csv"
    table = pd.read_csv(esol).head(60)
    table.assign(y=(table[ESOL_TARGET] > table[ESOL_TARGET].median()).astype(int))[["smiles", "y"]].to_csv(
        labels, index=False)
    monkeypatch.setattr(builtins, "open", counted_open)
    monkeypatch.setattr(io, "open", counted_open)
    dm = CSVDataModule(path=str(labels), task="classification", split="scaffold", molecule_descriptors=True,
                       cache_root=str(tmp_path / "cache"), build_workers=1, encode_threads=1)
    dm.prepare_data()
    for stage in ("fit", "test", "predict"):
        dm.setup(stage)
    dm.descriptor_statistics()
    assert len(dm.predict_smiles()) == len(dm.splits["predict"])
    assert calls == {"open": 1, "read": 1, "hash": 1}

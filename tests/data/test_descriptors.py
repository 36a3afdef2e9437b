"""Label-free pretraining targets: RDKit descriptors of real ZINC molecules, standardized,
cached, served by ``DescriptorDataModule``; split files for CSV sets."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from graphormer_urpe.data import CSVDataModule, DescriptorDataModule
from graphormer_urpe.data import descriptors as desc
from graphormer_urpe.data.descriptor_pretraining import read_smiles_file
from graphormer_urpe.data.property_csv import read_split_file


def zinc_smiles_file(zinc_source: Path, path: Path, count: int, bad_line: int | None = None) -> list[str]:
    with gzip.open(zinc_source / "jtvae_train.smi.gz", "rt") as f:
        smiles = [next(f).strip() for _ in range(count)]
    lines = list(smiles)
    if bad_line is not None:
        lines.insert(bad_line, "C1CC(")  # RDKit rejects it
    path.write_text("\n".join(lines) + "\n")
    return smiles


def test_descriptor_targets_of_real_molecules_are_standardized_and_cached(zinc_source, tmp_path, monkeypatch):
    from rdkit import Chem
    from rdkit.Chem import Descriptors

    smiles = zinc_smiles_file(zinc_source, tmp_path / "zinc.smi", 300, bad_line=5)
    kwargs = dict(path=str(tmp_path / "zinc.smi"), cache_root=str(tmp_path / "cache"), build_workers=1,
                  encode_threads=1, split_fractions=(0.8, 0.1, 0.1))
    data = DescriptorDataModule(**kwargs)
    names = desc.descriptor_names()
    assert data.num_targets == len(names) >= 150 and "MolLogP" in names and "Ipc" not in names
    with pytest.warns(UserWarning, match=r"skipped 1 of 301 rows that RDKit or the featurizer rejects \(lines 7\)"):
        _, graph_of_row, y, splits = data.store()
    assert graph_of_row[5] < 0 and sum(len(r) for r in splits.values()) == 300
    assert not np.isin(5, np.concatenate(list(splits.values())))
    usable = np.delete(y, 5, axis=0)
    varying = usable.std(axis=0) > 0
    assert varying.sum() > 100  # most descriptors vary over 300 ZINC molecules
    np.testing.assert_allclose(usable[:, varying].mean(axis=0), 0, atol=0.05)
    np.testing.assert_allclose(usable[:, varying].std(axis=0), 1, atol=0.1)
    # the raw values are RDKit's: the standardized column is an increasing function of them
    logp = [Descriptors.MolLogP(Chem.MolFromSmiles(s)) for s in smiles]
    column = usable[:, names.index("MolLogP")]
    assert np.corrcoef(logp, column)[0, 1] > 0.999
    # served as a regression set: a batch of train graphs carries all targets
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    assert batch.y.shape[1] == data.num_targets and data.task == "regression"

    # a second module loads the cached descriptors instead of computing them again
    def no_recompute(_):
        raise AssertionError("descriptors computed again")

    monkeypatch.setattr(desc, "descriptor_chunk", no_recompute)
    again = DescriptorDataModule(**kwargs)
    with pytest.warns(UserWarning):
        np.testing.assert_array_equal(again.store()[2], y)
    # the split is drawn from split_seed, never from the training seed
    for seed, split_seed, same in ((1, 0, True), (0, 1, False)):
        other = DescriptorDataModule(**kwargs, seed=seed, split_seed=split_seed)
        with pytest.warns(UserWarning):
            assert np.array_equal(other.store()[3]["test"], splits["test"]) == same


def test_a_missing_smiles_file_is_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"SMILES file .*nothing\.smi does not exist"):
        DescriptorDataModule(path=str(tmp_path / "nothing.smi"))


def test_a_split_file_serves_exactly_its_rows(esol_csv, tmp_path):
    rows = {"train": list(range(0, 600)), "val": list(range(600, 700)), "test": list(range(700, 800))}
    split_file = tmp_path / "split.json"
    split_file.write_text(json.dumps([rows]))  # chemprop's form: a list of one object
    data = CSVDataModule(path=str(esol_csv), target_columns=["measured log solubility in mols per litre"],
                         split_file=str(split_file), cache_root=str(tmp_path / "cache"), build_workers=1,
                         encode_threads=1)
    served = data.store()[3]
    for name in rows:
        np.testing.assert_array_equal(served[name], rows[name])
    assert data.predict_smiles()[0] == __import__("pandas").read_csv(esol_csv)["smiles"][700]


@pytest.mark.parametrize("content, message", [
    ({"train": [0], "val": [1]}, "must hold"),
    ({"train": [0, 1], "val": [1], "test": [2]}, r"rows \[1\] are in both 'train' and 'val'"),
    ({"train": [0], "val": [1], "test": [5000]}, r"'test' has rows \[5000\] outside the CSV's 1128 data rows"),
    ({"train": [0.5], "val": [1], "test": [2]}, "must be a list of integer rows"),
])
def test_a_bad_split_file_is_refused_by_name(tmp_path, content, message):
    path = tmp_path / "split.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=message) as info:
        read_split_file(path, 1128)
    assert str(path) in str(info.value)


def test_an_empty_smiles_file_is_one_line(tmp_path):
    (tmp_path / "empty.smi").write_text("\n\n")
    data = DescriptorDataModule(path=str(tmp_path / "empty.smi"), cache_root=str(tmp_path / "cache"), build_workers=1)
    with pytest.raises(ValueError, match=r"empty\.smi holds no SMILES"):
        data.store()


def test_a_csv_with_a_smiles_column_alone_is_read(zinc_source, tmp_path):
    smiles = zinc_smiles_file(zinc_source, tmp_path / "zinc.smi", 30)
    (tmp_path / "zinc.csv").write_text("smiles\n" + "\n".join(smiles) + "\n")
    assert read_smiles_file(tmp_path / "zinc.csv") == smiles
    with pytest.raises(ValueError, match=r"zinc\.csv has no SMILES column 'SMILES'"):
        read_smiles_file(tmp_path / "zinc.csv", smiles_column="SMILES")

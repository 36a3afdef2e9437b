"""PCQM4Mv2 in the OGB-LSC layout: fixture builder and DataModule (equality with OGB's own dataset:
test_pcqm4m.py, for both versions)."""
from __future__ import annotations

import builtins

import numpy as np
import pytest
import torch

from graphormer_urpe.data.datamodule import PCQM4Mv2DataModule
from graphormer_urpe.data.featurize import OGB_ATOM_FEATURE_DIMS, OGB_BOND_FEATURE_DIMS
from graphormer_urpe.data.pcqm4mv2 import (
    RELEASE_MARKER, SPLITS, ogb_pcqm4mv2_dataset, read_pcqm4mv2_table, read_split_dict, write_pcqm4mv2_root,
)


@pytest.fixture(scope="module")
def pcqm_source(shared_data_dir):
    return shared_data_dir / "pcqm4mv2" / "pcqm4mv2_first2k_3d.csv.gz"


@pytest.fixture(scope="module")
def pcqm_root(pcqm_source, tmp_path_factory):
    root = tmp_path_factory.mktemp("pcqm")
    write_pcqm4mv2_root(root, pcqm_source)
    return root


@pytest.fixture(autouse=True)
def no_stdin(monkeypatch):
    """OGB must never ask anything."""
    def refuse(*args):
        raise AssertionError(f"input() was called: {args}")

    monkeypatch.setattr(builtins, "input", refuse)


def test_ogb_feature_vocabularies_are_ogbs():
    from ogb.utils.features import get_atom_feature_dims, get_bond_feature_dims

    assert list(OGB_ATOM_FEATURE_DIMS) == get_atom_feature_dims()
    assert list(OGB_BOND_FEATURE_DIMS) == get_bond_feature_dims()


def test_fixture_root_has_the_official_layout(pcqm_root):
    splits = read_split_dict(pcqm_root)
    assert {k: len(v) for k, v in splits.items()} == {"train": 1599, "valid": 200, "test-dev": 100,
                                                       "test-challenge": 100}
    assert np.array_equal(np.sort(np.concatenate(list(splits.values()))), np.arange(1999))
    smiles, gap = read_pcqm4mv2_table(pcqm_root)
    assert abs(gap[0] - 3.0476751256) < 1e-6  # PCQM4Mv2 idx 0
    assert "[H]" not in smiles[0] and "|" not in smiles[0]  # hydrogens and coordinates removed
    for split in SPLITS:
        assert np.isnan(gap[splits[split]]).all() == (split.startswith("test"))


def test_datamodule_serves_ogb_splits(pcqm_root):
    dm = PCQM4Mv2DataModule(root=str(pcqm_root), eval_batch_size=64)
    assert (dm.num_atom_embeddings, dm.num_bond_embeddings, dm.num_targets) == (175, 14, 1)
    assert dm.featurizer == "ogb" and dm.task == "regression"
    dm.setup("fit")
    _, gaps = read_pcqm4mv2_table(pcqm_root)
    valid_rows = read_split_dict(pcqm_root)["valid"]
    val = list(dm.val_dataloader())
    assert torch.cat([b.index for b in val]).tolist() == list(range(200))
    np.testing.assert_array_equal(torch.cat([b.y for b in val])[:, 0].numpy(), gaps[valid_rows])
    predict = list(dm.predict_dataloader())
    assert sum(len(b) for b in predict) == 100 and all(torch.isnan(b.y).all() for b in predict)
    with pytest.raises(ValueError, match="predict_split"):
        PCQM4Mv2DataModule(root=str(pcqm_root), predict_split="test")


def test_official_test_sizes_reuse_featurized_molecules(pcqm_source, tmp_path):
    sizes = {"train": 3000, "valid": 500, "test-dev": 147_037, "test-challenge": 147_432}
    write_pcqm4mv2_root(tmp_path, pcqm_source, split_sizes=sizes)
    dm = PCQM4Mv2DataModule(root=str(tmp_path), build_workers=2, eval_batch_size=4096)
    graphs, graph_of_row, _, _ = dm.store()
    assert len(graphs) == 1999 and len(graph_of_row) == sum(sizes.values())  # distinct molecules only
    dm.setup("predict")
    dataset = dm.splits["predict"]
    assert len(dataset) == 147_037
    last = dataset.__getitems__(list(range(147_000, 147_037)))
    assert last.index.tolist() == list(range(147_000, 147_037)) and torch.isnan(last.y).all()
    dm_challenge = PCQM4Mv2DataModule(root=str(tmp_path), predict_split="test-challenge")
    dm_challenge.setup("predict")
    assert len(dm_challenge.predict_dataloader().dataset) == 147_432


def test_split_dict_loads_with_weights_only_and_no_lasting_allow_list(pcqm_root):
    before = set(map(str, torch.serialization.get_safe_globals()))
    assert set(read_split_dict(pcqm_root)) == set(SPLITS)
    assert set(map(str, torch.serialization.get_safe_globals())) == before
    with pytest.raises(Exception, match="[Ww]eights only"):  # a bare weights_only load refuses it
        torch.load(pcqm_root / "pcqm4m-v2" / "split_dict.pt")


def test_no_prompt_on_stale_or_missing_folders(pcqm_root, tmp_path):
    (tmp_path / "pcqm4m-v2").mkdir()
    with pytest.raises(ValueError, match=RELEASE_MARKER):
        ogb_pcqm4mv2_dataset(tmp_path)
    with pytest.raises(ValueError, match="split file"):
        read_split_dict(tmp_path)
    with pytest.raises(ValueError, match="download=True"):
        PCQM4Mv2DataModule(root=str(tmp_path)).prepare_data()

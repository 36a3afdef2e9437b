"""The OGB-LSC layouts of PCQM4M (v1) and PCQM4Mv2: fixture builder, equality with OGB's own datasets
on real molecules, the DataModules, and the checks on split dicts."""
from __future__ import annotations

import builtins
import shutil

import numpy as np
import pytest
import torch

from graphormer_urpe.data import PCQM4MDataModule, PCQM4Mv2DataModule
from graphormer_urpe.data.feature_ids import feature_offsets
from graphormer_urpe.data.featurize import (
    OGB_ATOM_FEATURE_DIMS, OGB_BOND_FEATURE_DIMS, cached_smiles_graphs, file_fingerprint,
)
from graphormer_urpe.data.ogb_lsc import (
    PCQM4M, PCQM4MV2, RAW_TABLE, RELEASE_MARKER, SPLIT_FILE, ogb_dataset, read_split_dict, read_table,
    require_layout, write_root,
)

DATAMODULES = {"PCQM4M": PCQM4MDataModule, "PCQM4Mv2": PCQM4Mv2DataModule}


@pytest.fixture(scope="module")
def v1_root(pcqm_source, tmp_path_factory):
    """A PCQM4M (v1) root of the 1,999 real molecules, split 1,599 / 200 / 200."""
    root = tmp_path_factory.mktemp("pcqm4m")
    write_root(root, pcqm_source, PCQM4M)
    return root


@pytest.fixture(autouse=True)
def no_stdin(monkeypatch):
    """OGB must never ask anything."""
    def refuse(*args):
        raise AssertionError(f"input() was called: {args}")

    monkeypatch.setattr(builtins, "input", refuse)


def test_layouts_have_the_official_names_and_sizes():
    assert PCQM4M.folder == "pcqm4m_kddcup2021" and PCQM4MV2.folder == "pcqm4m-v2"
    assert dict(PCQM4M.split_sizes) == {"train": 3_045_360, "valid": 380_670, "test": 377_423}
    assert PCQM4M.test_splits == ("test",) and PCQM4MV2.test_splits == ("test-dev", "test-challenge")
    assert PCQM4MV2.num_molecules == 3_746_620
    import ogb.lsc

    for layout in (PCQM4M, PCQM4MV2):
        assert hasattr(ogb.lsc, layout.ogb_dataset) and hasattr(ogb.lsc, layout.ogb_evaluator)


@pytest.mark.parametrize("layout", [PCQM4M, PCQM4MV2], ids=lambda layout: layout.name)
def test_featurization_equals_ogbs_own_dataset(layout, pcqm_source, tmp_path):
    write_root(tmp_path, pcqm_source, layout)
    import torch_geometric.data  # noqa: F401 - PyG allows its own classes on import

    before = set(map(str, torch.serialization.get_safe_globals()))
    dataset, ogb_splits = ogb_dataset(tmp_path, layout)
    # The numpy allow-list lasted only for the call, and what was allowed before still is (PyG's
    # Data: without it ZINC's processed files no longer load as data).
    assert np.ndarray not in torch.serialization.get_safe_globals()
    assert set(map(str, torch.serialization.get_safe_globals())) == before
    graphs, graph_of_row, y, splits = DATAMODULES[layout.name](root=str(tmp_path), build_workers=2).store()
    assert list(splits) == list(layout.splits)
    for split in layout.splits:
        assert np.array_equal(ogb_splits[split].numpy(), splits[split])
    ogb, slices = dataset._data, dataset.slices
    assert len(dataset) == len(graph_of_row) == 1999
    node_ptr, edge_ptr = slices["x"].numpy(), slices["edge_index"].numpy()
    # Raw OGB feature values: undo the shared-id offsets of the stored graphs.
    atom_offsets, bond_offsets = feature_offsets(OGB_ATOM_FEATURE_DIMS), feature_offsets(OGB_BOND_FEATURE_DIMS)
    for row in range(1999):
        g = graph_of_row[row]
        n0, n1 = graphs.node_ptr[g], graphs.node_ptr[g + 1]
        e0, e1 = graphs.edge_ptr[g], graphs.edge_ptr[g + 1]
        assert np.array_equal(graphs.x[n0:n1] - atom_offsets, ogb.x[node_ptr[row]:node_ptr[row + 1]].numpy())
        assert np.array_equal(graphs.edge_attr[e0:e1] - bond_offsets,
                              ogb.edge_attr[edge_ptr[row]:edge_ptr[row + 1]].numpy())
    # Edges: the featurized cache entry the DataModule built (loaded, never recomputed here).
    folder = layout.path(tmp_path)
    cached = cached_smiles_graphs(folder / "processed_graphormer_urpe" / "graphs",
                                  file_fingerprint(folder / RAW_TABLE), lambda: pytest.fail("cache missed"), "ogb")
    assert np.array_equal(graph_of_row, np.arange(1999))  # the 1,999 molecules are distinct
    assert np.array_equal(cached["edge_index"].astype(np.int64), ogb.edge_index.numpy())
    assert np.array_equal(cached["node_ptr"], node_ptr) and np.array_equal(cached["edge_ptr"], edge_ptr)
    np.testing.assert_array_equal(y[:, 0], ogb.y.numpy())  # NaN == NaN for the test sets


def test_v1_datamodule_serves_ogb_splits(v1_root):
    dm = PCQM4MDataModule(root=str(v1_root), eval_batch_size=64)
    assert (dm.num_atom_embeddings, dm.num_bond_embeddings, dm.num_targets) == (175, 14, 1)
    assert dm.split_names == {"train": "train", "val": "valid", "test": "valid", "predict": "test"}
    dm.setup("fit")
    _, gaps = read_table(v1_root, PCQM4M)
    splits = read_split_dict(v1_root, PCQM4M)
    assert {k: len(v) for k, v in splits.items()} == {"train": 1599, "valid": 200, "test": 200}
    val = list(dm.val_dataloader())
    assert torch.cat([b.index for b in val]).tolist() == list(range(200))
    np.testing.assert_array_equal(torch.cat([b.y for b in val])[:, 0].numpy(), gaps[splits["valid"]])
    predict = list(dm.predict_dataloader())
    assert sum(len(b) for b in predict) == 200 and all(torch.isnan(b.y).all() for b in predict)
    with pytest.raises(ValueError, match="predict_split must be one of .*'test'.* for PCQM4M"):
        PCQM4MDataModule(root=str(v1_root), predict_split="test-dev")


def _bad_split_dicts(splits: dict[str, np.ndarray], num_rows: int) -> dict[str, tuple[dict, str]]:
    train, valid, test = splits["train"], splits["valid"], splits["test"]
    return {
        "negative": ({**splits, "test": np.r_[test[:-1], -1]}, r"'test' has negative rows, e.g. \[-1\]"),
        "past the end": ({**splits, "valid": np.r_[valid, num_rows]}, r"'valid' has rows outside.*1999"),
        "overlap": ({**splits, "test": np.r_[test, train[:3]]}, r"splits 'train' and 'test' share 3 rows"),
        "repeated": ({**splits, "train": np.r_[train, train[:1]]}, r"'train' repeats rows"),
        "unlabelled valid": ({**splits, "valid": np.r_[valid, test[:2]], "test": test[2:]},
                             r"'valid' has 2 rows without a finite homolumogap"),
        "missing split": ({"train": train, "valid": valid}, r"lacks splits \['test'\]"),
        "not indices": ({**splits, "train": train.astype(np.float32)}, r"'train' must be a 1-D array of integer"),
    }


def test_split_dict_is_checked_before_anything_is_served(v1_root, tmp_path):
    """Rows that would wrap around, overlap another split or lack a label are refused by name."""
    splits = read_split_dict(v1_root, PCQM4M)
    for problem, (bad, message) in _bad_split_dicts(splits, 1999).items():
        root = tmp_path / problem.replace(" ", "_")
        shutil.copytree(v1_root, root)  # with the featurized molecules: only the split dict differs
        torch.save(bad, PCQM4M.path(root) / SPLIT_FILE)
        with pytest.raises(ValueError, match=message):
            PCQM4MDataModule(root=str(root)).prepare_data()
    assert require_layout(v1_root, PCQM4M) == v1_root / "pcqm4m_kddcup2021"


@pytest.mark.parametrize("layout", [PCQM4M, PCQM4MV2], ids=lambda layout: layout.name)
def test_missing_files_are_named_and_ogb_never_prompts(layout, tmp_path):
    """Missing or stale folders: one error naming what is missing, never OGB's download prompt."""
    with pytest.raises(ValueError, match="not a directory"):
        require_layout(tmp_path / "nowhere", layout)
    layout.path(tmp_path).mkdir()
    with pytest.raises(ValueError, match=rf"{layout.name} file\(s\) missing: .*data.csv.gz, .*split_dict.pt"):
        require_layout(tmp_path, layout)
    with pytest.raises(ValueError, match=RELEASE_MARKER):
        ogb_dataset(tmp_path, layout)
    with pytest.raises(ValueError, match="split file"):
        read_split_dict(tmp_path, layout)
    with pytest.raises(ValueError, match="download=True"):
        DATAMODULES[layout.name](root=str(tmp_path)).prepare_data()



# PCQM4Mv2 ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pcqm_root(pcqm_source, tmp_path_factory):
    root = tmp_path_factory.mktemp("pcqm")
    write_root(root, pcqm_source, PCQM4MV2)
    return root


def test_ogb_feature_vocabularies_are_ogbs():
    from ogb.utils.features import get_atom_feature_dims, get_bond_feature_dims

    assert list(OGB_ATOM_FEATURE_DIMS) == get_atom_feature_dims()
    assert list(OGB_BOND_FEATURE_DIMS) == get_bond_feature_dims()


def test_fixture_root_has_the_official_layout(pcqm_root):
    splits = read_split_dict(pcqm_root, PCQM4MV2)
    assert {k: len(v) for k, v in splits.items()} == {"train": 1599, "valid": 200, "test-dev": 100,
                                                       "test-challenge": 100}
    assert np.array_equal(np.sort(np.concatenate(list(splits.values()))), np.arange(1999))
    smiles, gap = read_table(pcqm_root, PCQM4MV2)
    assert abs(gap[0] - 3.0476751256) < 1e-6  # PCQM4Mv2 idx 0
    assert "[H]" not in smiles[0] and "|" not in smiles[0]  # hydrogens and coordinates removed
    for split in PCQM4MV2.splits:
        assert np.isnan(gap[splits[split]]).all() == (split.startswith("test"))


def test_datamodule_serves_ogb_splits(pcqm_root):
    dm = PCQM4Mv2DataModule(root=str(pcqm_root), eval_batch_size=64)
    assert (dm.num_atom_embeddings, dm.num_bond_embeddings, dm.num_targets) == (175, 14, 1)
    assert dm.featurizer == "ogb" and dm.task == "regression"
    dm.setup("fit")
    _, gaps = read_table(pcqm_root, PCQM4MV2)
    valid_rows = read_split_dict(pcqm_root, PCQM4MV2)["valid"]
    val = list(dm.val_dataloader())
    assert torch.cat([b.index for b in val]).tolist() == list(range(200))
    np.testing.assert_array_equal(torch.cat([b.y for b in val])[:, 0].numpy(), gaps[valid_rows])
    predict = list(dm.predict_dataloader())
    assert sum(len(b) for b in predict) == 100 and all(torch.isnan(b.y).all() for b in predict)
    with pytest.raises(ValueError, match="predict_split"):
        PCQM4Mv2DataModule(root=str(pcqm_root), predict_split="test")


def test_official_test_sizes_reuse_featurized_molecules(pcqm_source, tmp_path):
    sizes = {"train": 3000, "valid": 500, "test-dev": 147_037, "test-challenge": 147_432}
    write_root(tmp_path, pcqm_source, PCQM4MV2, split_sizes=sizes)
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
    assert set(read_split_dict(pcqm_root, PCQM4MV2)) == set(PCQM4MV2.splits)
    assert set(map(str, torch.serialization.get_safe_globals())) == before
    with pytest.raises(Exception, match="[Ww]eights only"):  # a bare weights_only load refuses it
        torch.load(pcqm_root / "pcqm4m-v2" / "split_dict.pt")

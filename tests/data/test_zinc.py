"""ZINC through PyG's unchanged ``ZINC`` class, with raw files rebuilt offline from SMILES."""
from __future__ import annotations

import gzip
from collections import Counter

import numpy as np
import pytest

from graphormer_urpe.data.featurize import ZINC_ATOM_TOKENS, smiles_to_zinc_dense
from graphormer_urpe.data.local_data import DATA_ENV
from graphormer_urpe.data.zinc import ZINC_SOURCE_ENV, load_zinc, resolve_zinc_source


def _lines(path):
    with gzip.open(path, "rt") as f:
        return [line.strip() for line in f if line.strip()]


def _index(path):
    return [int(v) for v in path.read_text().strip().split(",")]


@pytest.mark.parametrize("subset, sizes", [
    (True, (10_000, 1_000, 1_000)),
    pytest.param(False, (220_011, 24_445, 5_000), marks=pytest.mark.slow),  # PyG processes 250k graphs once
])
def test_split_sizes(zinc_root, subset, sizes):
    assert tuple(len(load_zinc(zinc_root, subset=subset, split=s)) for s in ("train", "val", "test")) == sizes


@pytest.mark.parametrize("split", ["val", "test"])
def test_subset_val_test_are_the_exact_official_graphs(zinc_root, zinc_source, split):
    official = np.load(zinc_source / f"subset_{split}_graphs.npz")
    dataset = load_zinc(zinc_root, subset=True, split=split)
    data, slices = dataset._data, dataset.slices
    assert np.array_equal(data.x.numpy().reshape(-1), official["x"])
    assert np.array_equal(data.edge_index.numpy(), official["edge_index"])
    assert np.array_equal(data.edge_attr.numpy(), official["edge_attr"])
    assert data.y.dtype.is_floating_point and np.array_equal(data.y.numpy(), official["y"])
    assert np.array_equal(slices["x"].numpy(), official["node_ptr"])
    assert np.array_equal(slices["edge_index"].numpy(), official["edge_ptr"])


def test_rebuilt_train_graphs_carry_the_source_labels_and_smiles_graphs(zinc_root, zinc_source):
    dataset = load_zinc(zinc_root, subset=True, split="train")
    positions = _index(zinc_source / "subset_train.index")
    smiles = _lines(zinc_source / "jtvae_train.smi.gz")
    labels = np.array(_lines(zinc_source / "jtvae_train.y.gz"), dtype=np.float32)
    for g in (0, 1, 4321, 9999):
        atom_type, bond_type = smiles_to_zinc_dense(smiles[positions[g]])
        graph = dataset[g]
        assert graph.y.item() == labels[positions[g]]
        assert np.array_equal(graph.x.numpy().reshape(-1), atom_type)
        assert np.array_equal(graph.edge_index.numpy(), np.stack(np.nonzero(bond_type)))


@pytest.mark.parametrize("split", ["val", "test"])
def test_smiles_rebuild_agrees_with_all_exact_graphs(zinc_source, split):
    """Node count, edge count, atom-token multiset and bond-type counts of every rebuilt subset
    graph equal the official graph's."""
    official = np.load(zinc_source / f"subset_{split}_graphs.npz")
    smiles = _lines(zinc_source / f"jtvae_{'valid' if split == 'val' else split}.smi.gz")
    node_ptr, edge_ptr = official["node_ptr"], official["edge_ptr"]
    mismatches = []
    for g, position in enumerate(_index(zinc_source / f"subset_{split}.index")):
        atom_type, bond_type = smiles_to_zinc_dense(smiles[position])
        exact_atoms = official["x"][node_ptr[g]:node_ptr[g + 1]]
        exact_bonds = official["edge_attr"][edge_ptr[g]:edge_ptr[g + 1]]
        rebuilt_bonds = bond_type[bond_type > 0]
        if (len(atom_type) != len(exact_atoms) or len(rebuilt_bonds) != len(exact_bonds)
                or Counter(atom_type.tolist()) != Counter(exact_atoms.tolist())
                or Counter(rebuilt_bonds.tolist()) != Counter(exact_bonds.tolist())):
            mismatches.append(g)
    assert len(node_ptr) - 1 == 1000 and mismatches == []


def test_vocabulary_matches_the_source(zinc_source):
    import json

    assert tuple(json.loads((zinc_source / "atom_dict.json").read_text())["idx2word"]) == ZINC_ATOM_TOKENS


def test_source_resolution(zinc_source, tmp_path, monkeypatch):
    monkeypatch.delenv(ZINC_SOURCE_ENV, raising=False)
    monkeypatch.setenv(DATA_ENV, str(tmp_path / "copies"))
    assert resolve_zinc_source(None) is None  # no local copy: PyG downloads
    (tmp_path / "copies").mkdir()
    (tmp_path / "copies" / "zinc").symlink_to(zinc_source, target_is_directory=True)
    assert resolve_zinc_source(None) == tmp_path / "copies" / "zinc"  # the local copies' zinc/
    monkeypatch.setenv(ZINC_SOURCE_ENV, str(zinc_source))
    assert resolve_zinc_source(None) == zinc_source  # a ZINC directory named on its own wins
    assert resolve_zinc_source(zinc_source) == zinc_source  # the argument wins over the variables
    with pytest.raises(ValueError, match="lacks .*jtvae_train.smi.gz"):
        resolve_zinc_source(tmp_path)


def test_unknown_split_and_bad_smiles():
    with pytest.raises(ValueError, match="split"):
        load_zinc("unused", split="valid")
    with pytest.raises(ValueError, match="cannot parse"):
        smiles_to_zinc_dense("C1CC")


def test_missing_raw_file_with_complete_processed_rebuilds_cleanly(zinc_root, zinc_source, tmp_path, monkeypatch):
    """One raw file deleted, ``processed/`` intact: the raw dir is rebuilt (not ``Directory not
    empty``), every rerun loads, and PyG keeps serving the processed graphs."""
    import shutil

    from graphormer_urpe.data import zinc

    root = tmp_path / "ZINC"
    shutil.copytree(zinc_root / "raw", root / "raw")
    shutil.copytree(zinc_root / "subset", root / "subset")
    (root / "raw" / "val.index").unlink()
    expected = load_zinc(zinc_root, subset=True, split="val")
    # the raw rebuild itself is tested above; here only its placement matters, so keep it fast
    monkeypatch.setattr(zinc, "zinc_graphs_from_smiles", lambda smiles, *a, **k: [
        (np.zeros(1, np.uint8), np.zeros((1, 1), np.uint8)) for _ in smiles])
    for _ in range(2):
        dataset = load_zinc(root, subset=True, split="val", source_dir=zinc_source)
        assert all((root / "raw" / name).is_file() for name in zinc._RAW_FILES)
        assert len(dataset) == 1_000 and dataset._data.x.equal(expected._data.x)
    assert sorted(p.name for p in root.iterdir()) == ["raw", "subset"]  # nothing stray left


class _OpensAFileWhenUnpickled:
    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def test_a_planted_raw_pickle_is_refused_without_running_its_code(zinc_root, tmp_path):
    """PyG's ZINC reads raw ``{split}.pickle`` with ``pickle.load``: a raw file whose unpickling
    calls anything but the tensor and array builders is refused, naming the file and the call,
    and its code never runs. Raw files with tensors pickled by torch (PyG's download) load."""
    import io
    import pickle

    import torch

    from graphormer_urpe.data.zinc import RawZincUnpickler

    root = tmp_path / "ZINC"
    (root / "raw").mkdir(parents=True)
    for name in ("train.index", "val.pickle", "val.index", "test.pickle", "test.index"):
        (root / "raw" / name).symlink_to(zinc_root / "raw" / name)
    marker = tmp_path / "code-ran"
    with open(root / "raw" / "train.pickle", "wb") as f:
        pickle.dump([{"atom_type": _OpensAFileWhenUnpickled(marker)}], f)
    with pytest.raises(pickle.UnpicklingError, match=r"train\.pickle: not a ZINC raw file: it calls "
                                                     r"(builtins|io)\.open when loaded"):
        load_zinc(root, subset=True, split="train")
    assert not marker.exists()

    with open(zinc_root / "raw" / "test.pickle", "rb") as f:
        ours = RawZincUnpickler(f).load()
    assert isinstance(ours[0]["atom_type"], torch.Tensor)
    by_torch = [{key: value.clone() for key, value in mol.items()} for mol in ours[:50]]
    again = RawZincUnpickler(io.BytesIO(pickle.dumps(by_torch))).load()
    assert all(a[key].equal(b[key]) for a, b in zip(again, by_torch) for key in a)


def test_zinc_that_no_copy_holds_and_no_download_gives_is_refused_in_one_line(tmp_path, monkeypatch, run_main):
    """No ZINC source files in the local data copies and PyG's download failing (here a ``file:``
    URL of a missing file): one line naming where the files belong and the download, exit 2."""
    from torch_geometric.datasets import ZINC

    from graphormer_urpe.cli.fit import main

    monkeypatch.setenv(DATA_ENV, str(tmp_path / "copies"))
    monkeypatch.delenv(ZINC_SOURCE_ENV, raising=False)
    gone = (tmp_path / "gone.zip").as_uri()
    monkeypatch.setattr(ZINC, "url", gone)
    monkeypatch.chdir(tmp_path)
    done = run_main(main, ["fit", "--config", "zinc", "--trainer.default_root_dir", tmp_path / "run"])
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert [line for line in lines if line.startswith("graphormer-urpe: error: ")] == lines[-1:]
    assert lines[-1].startswith(f"graphormer-urpe: error: ZINC: no local copy of its source files (expected at "
                                f"{tmp_path / 'copies' / 'zinc'} ($GRAPHORMER_URPE_DATA"), lines[-1]
    assert f"or --data.init_args.source_dir) and the download of {gone} into data/ZINC/raw failed (" in lines[-1]


def test_a_source_graphs_file_holding_an_object_array_is_refused_in_one_line(zinc_source, tmp_path, monkeypatch,
                                                                             run_main):
    """A ``subset_val_graphs.npz`` whose ``y`` is an object array (which only unpickling, never
    done, would read): one line naming the file, exit 2, before any SMILES is featurized."""
    from graphormer_urpe.cli.fit import main
    from graphormer_urpe.data import zinc

    source = tmp_path / "source"
    source.mkdir()
    for path in zinc_source.iterdir():
        (source / path.name).symlink_to(path)
    planted = source / "subset_val_graphs.npz"
    planted.unlink()
    with np.load(zinc_source / "subset_val_graphs.npz") as official:
        arrays = {name: official[name] for name in official.files}
    np.savez(planted, **{**arrays, "y": np.array([{"not": "a number"}] * len(arrays["y"]), dtype=object)})
    monkeypatch.setattr(zinc, "zinc_graphs_from_smiles", lambda *a, **k: pytest.fail("SMILES featurized"))
    done = run_main(main, ["fit", "--config", "zinc", "--data.init_args.source_dir", source,
                           "--data.init_args.root", tmp_path / "data", "--trainer.default_root_dir", tmp_path / "run"])
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert [line for line in lines if line.startswith("graphormer-urpe: error: ")] == lines[-1:]
    assert lines[-1] == (f"graphormer-urpe: error: {planted} does not hold ZINC's subset graphs (Object arrays "
                         "cannot be loaded when allow_pickle=False); replace it with the file of the ZINC source files")

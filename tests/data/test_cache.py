"""The encoding cache: computed once, reloaded lazily, invalidated by any change, crash-safe."""
from __future__ import annotations

import json

import numpy as np
import pytest

from graphormer_urpe import algos
from graphormer_urpe.data import cache
from graphormer_urpe.data.cache import cached_encodings, load_arrays, save_arrays


@pytest.fixture(scope="module")
def zinc_val(shared_data_dir):
    """The 1,000 official ZINC-12k val graphs as flat arrays."""
    arrays = np.load(shared_data_dir / "zinc" / "subset_val_graphs.npz")
    return arrays["node_ptr"], np.ascontiguousarray(arrays["edge_index"]), arrays["edge_ptr"]


@pytest.fixture
def count_encodes(monkeypatch):
    calls = []
    real = algos.encode_graphs

    def counting(*args, **kwargs):
        calls.append(args[3])
        return real(*args, **kwargs)

    monkeypatch.setattr(algos, "encode_graphs", counting)
    return calls


def test_cache_computes_once_then_loads_memory_mapped(zinc_val, tmp_path, count_encodes):
    node_ptr, edge_index, edge_ptr = zinc_val
    first = cached_encodings(tmp_path / "val-k5", node_ptr, edge_index, edge_ptr, max_hops=5)
    second = cached_encodings(tmp_path / "val-k5", node_ptr, edge_index, edge_ptr, max_hops=5)
    assert count_encodes == [5]
    direct = algos.encode_graphs(node_ptr, edge_index, edge_ptr, 5)
    assert isinstance(second["spd"], np.memmap) and not second["spd"].flags.writeable
    for name, expected in [("spd", direct.spd), ("path_edges", direct.path_edges.reshape(-1, 5)),
                           ("degree", direct.degree), ("pair_ptr", direct.pair_ptr)]:
        assert np.array_equal(first[name], expected) and np.array_equal(second[name], expected)
        assert second[name].dtype == expected.dtype  # compact dtypes kept (int16 encodings)


def test_changed_parameters_or_input_invalidate(zinc_val, tmp_path, count_encodes, monkeypatch):
    node_ptr, edge_index, edge_ptr = zinc_val
    entry = tmp_path / "val"
    cached_encodings(entry, node_ptr, edge_index, edge_ptr, max_hops=5)
    cached_encodings(entry, node_ptr, edge_index, edge_ptr, max_hops=3)  # parameter
    assert cached_encodings(entry, node_ptr, edge_index, edge_ptr, max_hops=3)["path_edges"].shape[1] == 3
    rewired = edge_index.copy()
    rewired[:, [0, 1]] = rewired[:, [1, 0]]  # same sizes, other edge order -> other path edge ids
    cached_encodings(entry, node_ptr, rewired, edge_ptr, max_hops=3)  # input
    monkeypatch.setattr(algos, "ENCODER_VERSION", "a new encoder", raising=False)
    cached_encodings(entry, node_ptr, rewired, edge_ptr, max_hops=3)  # encoder version
    assert count_encodes == [5, 3, 3, 3]


def test_interrupted_write_never_leaves_a_valid_entry(tmp_path, monkeypatch):
    arrays = {"a": np.arange(10, dtype=np.int16), "b": np.ones((3, 2), np.float32)}
    fingerprint = {"max_hops": 5}
    real_save = np.save

    def dying_save(file, array, **kwargs):
        if array.dtype == np.float32:
            raise KeyboardInterrupt  # the run is killed while writing the second array
        real_save(file, array, **kwargs)

    monkeypatch.setattr(cache.np, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        save_arrays(tmp_path / "entry", arrays, fingerprint)
    monkeypatch.setattr(cache.np, "save", real_save)
    assert load_arrays(tmp_path / "entry", fingerprint) is None
    assert list(tmp_path.iterdir()) == []  # not even the temporary directory is left

    save_arrays(tmp_path / "entry", arrays, fingerprint)
    loaded = load_arrays(tmp_path / "entry", fingerprint)
    assert loaded is not None and np.array_equal(loaded["b"], arrays["b"])
    assert load_arrays(tmp_path / "entry", {"max_hops": 4}) is None
    # A file damaged after the fact (truncated) or a corrupt manifest is not trusted either.
    data = (tmp_path / "entry" / "a.npy").read_bytes()
    (tmp_path / "entry" / "a.npy").write_bytes(data[:-4])
    assert load_arrays(tmp_path / "entry", fingerprint) is None
    save_arrays(tmp_path / "entry", arrays, fingerprint)  # replaces the damaged entry
    assert load_arrays(tmp_path / "entry", fingerprint) is not None
    manifest = json.loads((tmp_path / "entry" / "manifest.json").read_text())
    assert manifest["arrays"]["a"] == {"dtype": "<i2", "shape": [10]}
    (tmp_path / "entry" / "manifest.json").write_text("{")
    assert load_arrays(tmp_path / "entry", fingerprint) is None

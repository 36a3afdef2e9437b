"""The encoding cache: computed once, reloaded lazily, invalidated by any change, crash-safe."""
from __future__ import annotations

import json

import numpy as np
import pytest

from graphormer_urpe.data import algos, array_store, encodings
from graphormer_urpe.data.array_store import load_arrays
from graphormer_urpe.data.encodings import EncodingParams, cached_encodings


@pytest.fixture(scope="module")
def zinc_val(zinc_source):
    """The 1,000 official ZINC-12k val graphs as flat arrays."""
    arrays = np.load(zinc_source / "subset_val_graphs.npz")
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
    first = cached_encodings(tmp_path / "val-k5", node_ptr, edge_index, edge_ptr, EncodingParams(max_hops=5))
    second = cached_encodings(tmp_path / "val-k5", node_ptr, edge_index, edge_ptr, EncodingParams(max_hops=5))
    assert count_encodes == [5]
    direct = algos.encode_graphs(node_ptr, edge_index, edge_ptr, 5)
    assert isinstance(second["spd"], np.memmap) and not second["spd"].flags.writeable
    for name, expected in direct.items():
        assert np.array_equal(first[name], expected) and np.array_equal(second[name], expected)
        assert second[name].dtype == expected.dtype  # compact dtypes kept (int16 encodings)


def test_changed_parameters_or_input_invalidate(zinc_val, tmp_path, count_encodes, monkeypatch):
    node_ptr, edge_index, edge_ptr = zinc_val
    entry = tmp_path / "val"
    cached_encodings(entry, node_ptr, edge_index, edge_ptr, EncodingParams(max_hops=5))
    cached_encodings(entry, node_ptr, edge_index, edge_ptr, EncodingParams(max_hops=3))  # parameter
    assert cached_encodings(entry, node_ptr, edge_index, edge_ptr, EncodingParams(max_hops=3))["path_edges"].shape[1] == 3
    rewired = edge_index.copy()
    rewired[:, [0, 1]] = rewired[:, [1, 0]]  # same sizes, other edge order -> other path edge ids
    cached_encodings(entry, node_ptr, rewired, edge_ptr, EncodingParams(max_hops=3))  # input
    monkeypatch.setattr(algos, "ENCODER_VERSION", "a new encoder", raising=False)
    cached_encodings(entry, node_ptr, rewired, edge_ptr, EncodingParams(max_hops=3))  # encoder version
    assert count_encodes == [5, 3, 3, 3]


def save_arrays(directory, arrays, fingerprint):
    """Write the cache entry ``directory`` in one piece, as the data builds do through ``EntryWriter``."""
    with array_store.EntryWriter(directory, fingerprint) as writer:
        for name, array in arrays.items():
            writer.write(name, array)
        writer.commit()


def test_interrupted_write_never_leaves_a_valid_entry(tmp_path, monkeypatch):
    arrays = {"a": np.arange(10, dtype=np.int16), "b": np.ones((3, 2), np.float32)}
    fingerprint = {"max_hops": 5}
    real_append = array_store.ArrayWriter.append

    def dying_append(self, block):
        if self.dtype == np.float32:
            raise KeyboardInterrupt  # the run is killed while writing the second array
        real_append(self, block)

    monkeypatch.setattr(array_store.ArrayWriter, "append", dying_append)
    with pytest.raises(KeyboardInterrupt):
        save_arrays(tmp_path / "entry", arrays, fingerprint)
    monkeypatch.setattr(array_store.ArrayWriter, "append", real_append)
    assert load_arrays(tmp_path / "entry", fingerprint) is None
    assert [p.name for p in tmp_path.iterdir()] == []  # not even the temporary directory is left

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
    assert manifest["arrays"]["a"] == {"dtype": "<i2", "shape": [10],
                                       "blake2b": array_store.file_checksum(tmp_path / "entry" / "a.npy")}
    (tmp_path / "entry" / "manifest.json").write_text("{")
    assert load_arrays(tmp_path / "entry", fingerprint) is None


def test_streamed_entry_equals_the_whole_arrays(tmp_path, monkeypatch):
    """Rows appended block by block (and ``[2, M]`` columns) give the same ``.npy`` as one save."""
    rng = np.random.default_rng(0)
    rows, columns = rng.integers(0, 9, (1000, 3)).astype(np.uint8), rng.integers(-5, 5, (2, 777)).astype(np.int16)
    with array_store.EntryWriter(tmp_path / "e", {"v": 1}) as writer:
        a, b = writer.array("rows", np.uint8, (3,)), writer.array("columns", np.int16, (2,), axis=1)
        for start in range(0, 1000, 300):
            a.append(rows[start:start + 300])
        for start in range(0, 777, 100):
            b.append(columns[:, start:start + 100])
        writer.array("empty", np.int64).append(np.zeros(0, np.int64))
        writer.commit()
    loaded = load_arrays(tmp_path / "e", {"v": 1}, verify=True)
    assert np.array_equal(loaded["rows"], rows) and np.array_equal(loaded["columns"], columns)
    assert loaded["empty"].shape == (0,)
    assert np.array_equal(np.load(tmp_path / "e" / "columns.npy"), columns)  # a plain .npy
    assert [p.name for p in tmp_path.iterdir()] == ["e"]


def test_chunked_encoding_equals_one_shot(zinc_val, tmp_path, monkeypatch, count_encodes):
    node_ptr, edge_index, edge_ptr = zinc_val
    monkeypatch.setattr(encodings, "PAIRS_PER_CHUNK", 5_000)  # ~20 graphs a chunk, 1,000 graphs
    chunks = len(encodings.graph_chunks(node_ptr))
    assert chunks > 20
    chunked = cached_encodings(tmp_path / "k3", node_ptr, edge_index, edge_ptr, EncodingParams(max_hops=3))
    assert len(count_encodes) == chunks  # one encoder call per chunk
    direct = algos.encode_graphs(node_ptr, edge_index, edge_ptr, 3)
    for name, expected in direct.items():
        assert np.array_equal(chunked[name], expected), name


def _damage_manifest(entry, change):
    manifest = json.loads((entry / "manifest.json").read_text())
    (entry / "manifest.json").write_text(json.dumps(change(manifest)))


DAMAGES = {
    "arrays is empty": (lambda e: _damage_manifest(e, lambda m: {**m, "arrays": {}}), "'arrays' is {}"),
    "dtype missing": (lambda e: _damage_manifest(e, lambda m: {**m, "arrays": {
        **m["arrays"], "spd": {k: v for k, v in m["arrays"]["spd"].items() if k != "dtype"}}}), "record of 'spd'"),
    "array not listed": (lambda e: _damage_manifest(e, lambda m: {**m, "arrays": {
        k: v for k, v in m["arrays"].items() if k != "degree"}}), "['degree'] are not listed"),
    "manifest is a list": (lambda e: _damage_manifest(e, lambda m: [m]), "is a list, not an object"),
    "0-byte array": (lambda e: (e / "spd.npy").write_bytes(b""), "spd.npy: empty (0 bytes)"),
    "truncated array": (lambda e: (e / "path_edges.npy").write_bytes((e / "path_edges.npy").read_bytes()[:-7]),
                        "path_edges.npy: unreadable"),
    "array deleted": (lambda e: (e / "degree.npy").unlink(), "degree.npy: missing"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_damaged_entry_is_rebuilt_naming_the_file(damage, zinc_val, tmp_path, count_encodes, caplog):
    node_ptr, edge_index, edge_ptr = zinc_val
    entry = tmp_path / "val-k3"
    expected = cached_encodings(entry, node_ptr, edge_index, edge_ptr, EncodingParams(max_hops=3))["spd"].copy()
    damage_entry, message = DAMAGES[damage]
    damage_entry(entry)
    with caplog.at_level("WARNING", logger="graphormer_urpe.data.array_store"):
        rebuilt = cached_encodings(entry, node_ptr, edge_index, edge_ptr, EncodingParams(max_hops=3))
    assert count_encodes == [3, 3] and np.array_equal(rebuilt["spd"], expected)
    assert f"cache entry {entry} is damaged, rebuilding it" in caplog.text and message in caplog.text
    assert load_arrays(entry, json.loads((entry / "manifest.json").read_text())["fingerprint"], verify=True)


def test_changed_bytes_are_caught_by_verification(zinc_val, tmp_path, count_encodes, caplog, monkeypatch):
    """Random bytes written into an array with its header intact load unless verifying
    (``verify=True`` or ``GRAPHORMER_URPE_VERIFY_CACHE=1``), which rebuilds the entry."""
    node_ptr, edge_index, edge_ptr = zinc_val
    entry = tmp_path / "val-k3"
    expected = cached_encodings(entry, node_ptr, edge_index, edge_ptr, EncodingParams(max_hops=3))["path_edges"].copy()
    fingerprint = json.loads((entry / "manifest.json").read_text())["fingerprint"]
    with open(entry / "path_edges.npy", "r+b") as f:
        f.seek(-100, 2)
        f.write(np.random.default_rng(0).integers(0, 256, 64, dtype=np.uint8).tobytes())
    assert load_arrays(entry, fingerprint) is not None  # cheap checks only: shape and dtype still match
    assert load_arrays(entry, fingerprint, verify=True) is None
    assert "path_edges.npy: checksum mismatch" in caplog.text
    monkeypatch.setenv(array_store.VERIFY_ENV, "1")
    rebuilt = cached_encodings(entry, node_ptr, edge_index, edge_ptr, EncodingParams(max_hops=3))
    assert count_encodes == [3, 3] and np.array_equal(rebuilt["path_edges"], expected)


def _build_slowly(entry, log_path):
    import time

    def build(writer):
        with open(log_path, "a") as f:
            f.write("built\n")
        time.sleep(0.5)
        writer.write("a", np.arange(5))

    return array_store.cached_entry(entry, {"v": 1}, build)["a"].tolist()


def test_concurrent_processes_build_an_entry_once(tmp_path):
    """DDP ranks (or jobs) sharing a cache: one builds under the lock, the other waits and loads."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(2) as pool:
        results = pool.starmap(_build_slowly, [(tmp_path / "e", tmp_path / "log")] * 2)
    assert results == [list(range(5))] * 2
    assert (tmp_path / "log").read_text() == "built\n"


def _featurize_distinct_in_memory(smiles: list[str], spec) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The reference for the streamed build: every distinct SMILES featurized once, in
    first-occurrence order, one molecule at a time; ``graph_of_row`` -1 where RDKit rejects it."""
    graph_of_smiles: dict[str, int] = {}
    xs, edge_indices, edge_attrs = [], [], []
    for s in dict.fromkeys(smiles):
        try:
            x, edge_index, edge_attr = spec.graph_arrays(s)
        except ValueError:
            graph_of_smiles[s] = -1
            continue
        graph_of_smiles[s] = len(xs)
        xs.append(x)
        edge_indices.append(edge_index)
        edge_attrs.append(edge_attr)
    graphs = {"x": np.concatenate(xs), "edge_index": np.concatenate(edge_indices, axis=1),
              "edge_attr": np.concatenate(edge_attrs),
              "node_ptr": np.cumsum([0] + [len(x) for x in xs]),
              "edge_ptr": np.cumsum([0] + [e.shape[1] for e in edge_indices])}
    return graphs, np.array([graph_of_smiles[s] for s in smiles])


def test_streamed_smiles_store_equals_in_memory_and_stays_memory_mapped(esol_csv, tmp_path):
    """The chunked build of a SMILES table (real ESOL, duplicated rows and a bad SMILES added)
    gives the in-memory featurization and encodings, and every per-molecule array of the served
    store is a memory map (training start copies nothing)."""
    import pandas as pd

    from graphormer_urpe.data.graphs import encode_flat, encode_smiles_store
    from graphormer_urpe.data.featurize import cached_smiles_graphs, featurizer_spec

    table = pd.read_csv(esol_csv)
    smiles = table["smiles"].tolist()[:300]
    smiles = smiles + smiles[:50] + ["not a smiles"]
    y = np.arange(len(smiles), dtype=np.float32)
    arrays = cached_smiles_graphs(tmp_path / "graphs", {"test": 1}, lambda: (smiles, y), "ogb",
                                  num_workers=2, chunk_size=37)
    spec = featurizer_spec("ogb")
    graphs, graph_of_row = _featurize_distinct_in_memory(smiles, spec)
    assert np.array_equal(arrays["graph_of_row"], graph_of_row) and graph_of_row[-1] == -1
    for name in ("x", "node_ptr", "edge_attr", "edge_ptr"):
        assert np.array_equal(arrays[name], graphs[name]), name
    assert np.array_equal(arrays["edge_index"], graphs["edge_index"]) and arrays["edge_index"].dtype == np.int16
    assert np.array_equal(arrays["y"][:, 0], y)

    params = EncodingParams(max_hops=4, rwse_steps=3)  # RWSE streamed into its own entry too
    store = encode_smiles_store(arrays, array_store.checksums(tmp_path / "graphs"), (tmp_path, "molecules"),
                                params, "ogb")
    expected = encode_flat(graphs["x"], graphs["node_ptr"], graphs["edge_index"], graphs["edge_attr"],
                           graphs["edge_ptr"], np.zeros(len(graphs["node_ptr"]) - 1), cache=(tmp_path, "direct"),
                           params=params, atom_feature_dims=spec.atom_feature_dims,
                           bond_feature_dims=spec.bond_feature_dims)
    assert sorted(p.name for p in (tmp_path / "encodings").iterdir() if not p.name.startswith(".")) == [
        "direct-k4", "direct-rwse3", "molecules-k4", "molecules-rwse3"]
    stored = {**{name: getattr(store, name) for name in ("x", "node_ptr", "edge_attr", "edge_ptr", "pair_ptr")},
              **store.encodings}
    assert list(store.encodings) == ["degree", "spd", "path_edges", "rwse"]
    for name, values in stored.items():
        assert isinstance(values, np.memmap), name
        reference = expected.encodings[name] if name in expected.encodings else getattr(expected, name)
        assert np.array_equal(values, reference), name
    again = encode_smiles_store(cached_smiles_graphs(tmp_path / "graphs", {"test": 1}, lambda: 1 / 0, "ogb"),
                                array_store.checksums(tmp_path / "graphs"), (tmp_path, "molecules"), params, "ogb")  # every entry loads: nothing is rebuilt
    assert np.array_equal(again.encodings["spd"], store.encodings["spd"])
    assert np.array_equal(again.encodings["rwse"], store.encodings["rwse"])

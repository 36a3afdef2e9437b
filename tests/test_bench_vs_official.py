"""scripts/bench_vs_official.py: the port of official Graphormer v1's ``algos.pyx`` (v1 is fed by
its own ``wrapper.preprocess_item`` and ``collator`` on machines without Cython), the seeded batch
draw, and, where ``GRAPHORMER_V1`` names v1's ``graphormer/`` directory (branch ``v1.0``), the
whole bench on a small batch of real ZINC test graphs."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import shortest_path

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_vs_official", REPO / "scripts" / "bench_vs_official.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def adjacency(n: int, edges: list[tuple[int, int]]) -> np.ndarray:
    adj = np.zeros([n, n], dtype=bool)
    for i, j in edges:
        adj[i, j] = adj[j, i] = True
    return adj


def test_floyd_warshall_port_gives_v1s_distances_and_510_for_unreachable(bench):
    rng = np.random.default_rng(0)
    for _ in range(20):
        n = int(rng.integers(2, 14))
        edges = [(i, j) for i in range(n) for j in range(i + 1, n) if rng.random() < 0.25]
        adj = adjacency(n, edges)
        dist, path = bench.V1_ALGOS.floyd_warshall(adj)
        expected = shortest_path(csr_matrix(adj.astype(float)), unweighted=True)
        assert np.array_equal(dist, np.where(np.isinf(expected), 510, expected).astype(np.int64))
        assert np.array_equal(path == 510, np.isinf(expected))


def test_edge_input_port_follows_v1s_paths_quirk_included(bench):
    # a chain 3 - 1 - 4 - 2 plus node 0 between 5 and 6; bond feature of edge (i, j) = 10 * i + j
    n = 7
    adj = adjacency(n, [(3, 1), (1, 4), (4, 2), (5, 0), (0, 6)])
    feat = np.zeros([n, n, 1], dtype=np.int64)
    for i, j in zip(*np.nonzero(adj)):
        feat[i, j, 0] = 10 * i + j
    dist, path = bench.V1_ALGOS.floyd_warshall(adj)
    out = bench.V1_ALGOS.gen_edge_input(dist[dist < 510].max(), path, feat)
    assert out.shape == (n, n, 3, 1)
    assert out[3, 2, :, 0].tolist() == [31, 14, 42]  # the edges along 3 -> 1 -> 4 -> 2
    assert out[2, 3, :, 0].tolist() == [24, 41, 13]
    assert out[3, 3, :, 0].tolist() == [-1, -1, -1]
    assert out[3, 5, :, 0].tolist() == [-1, -1, -1]  # unreachable
    # v1's get_all_edges reads "intermediate node 0" as "no intermediate": 5 -> 0 -> 6 becomes the
    # one absent edge (5, 6), whose feature is 0
    assert out[5, 6, :, 0].tolist() == [0, -1, -1]


def test_batches_are_seeded_draws_without_replacement(bench):
    a = bench.sample_indices(3, 1000, 64)
    assert a == bench.sample_indices(3, 1000, 64)
    assert len(set(a)) == 64 and max(a) < 1000
    assert a != bench.sample_indices(4, 1000, 64)


@pytest.mark.skipif(not os.environ.get("GRAPHORMER_V1"), reason="GRAPHORMER_V1 (v1's graphormer/ directory) not set")
def test_the_bench_feeds_v1_its_own_collator_and_agrees_on_our_paths(bench, zinc_data_root, capsys):
    result = bench.main(["--official", os.environ["GRAPHORMER_V1"], "--data-root", str(zinc_data_root),
                         "--batch-size", "4", "--seeds", "0", "1", "--steps", "1", "--warmup", "0",
                         "--threads", "1"])
    assert result["agreement"] < 1e-12
    assert result["seeds"] == [0, 1] and len(result["urpe_vs_official_per_batch"]) == 2
    assert all(1 <= hops <= 20 for hops in result["official_hops"])
    assert "official v1" in capsys.readouterr().out

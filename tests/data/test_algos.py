"""Tests of the graph-encoding core (:mod:`graphormer_urpe.data.algos`).

References: scipy's and networkx's unweighted shortest paths for distances, a pure-Python BFS with
the documented tie-breaking for the exact path choice, the real ZINC subset val/test graphs.
"""
from collections import deque

import networkx as nx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import shortest_path as scipy_shortest_path

from graphormer_urpe.data.algos import MAX_GRAPH_SIZE, MAX_HOPS_LIMIT, UNREACHABLE, encode_graphs, shortest_paths

FAST = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------------------- helpers
def scipy_spd(num_nodes: int, edge_index: np.ndarray) -> np.ndarray:
    """``[N, N]`` int64 hop counts from scipy, UNREACHABLE where infinite."""
    adjacency = csr_matrix((np.ones(edge_index.shape[1]), (edge_index[0], edge_index[1])),
                           shape=(num_nodes, num_nodes))
    dist = scipy_shortest_path(adjacency, unweighted=True)
    return np.where(np.isinf(dist), UNREACHABLE, dist).astype(np.int64)


def reference_encoding(num_nodes: int, edge_index: np.ndarray, max_hops: int):
    """Pure-Python BFS with the documented rule: neighbours in edge-id order, first discoverer
    is the parent, ``path(i, j) = path(i, parent(j)) + [edge(parent(j) -> j)]``."""
    neighbours = [[] for _ in range(num_nodes)]
    for k, (u, v) in enumerate(edge_index.T.tolist()):
        neighbours[u].append((v, k))
    spd = np.full((num_nodes, num_nodes), UNREACHABLE, dtype=np.int64)
    paths = np.full((num_nodes, num_nodes, max_hops), -1, dtype=np.int64)
    for s in range(num_nodes):
        full_path = {s: []}
        spd[s, s] = 0
        queue = deque([s])
        while queue:
            u = queue.popleft()
            for v, k in neighbours[u]:
                if v not in full_path:
                    full_path[v] = full_path[u] + [k]
                    spd[s, v] = len(full_path[v])
                    queue.append(v)
        for v, p in full_path.items():
            p = p[:max_hops]
            paths[s, v, :len(p)] = p
    return spd, paths


def assert_valid_paths(spd: np.ndarray, path_edges: np.ndarray, edge_index: np.ndarray):
    """Every stored path starts at i, is connected, each prefix of t hops reaches a node at
    distance t (so it is a shortest path), ends at j unless truncated, and is -1 padded."""
    n, _, max_hops = path_edges.shape
    num_edges = edge_index.shape[1]
    src, dst = np.append(edge_index, [[-1], [-1]], axis=1)       # column E: sentinel for -1
    length = np.where(spd > 0, np.minimum(spd, max_hops), 0)
    hops = np.arange(max_hops)
    used = hops < length[..., None]                                     # [n, n, K]
    assert (path_edges[~used] == -1).all(), "padding / diagonal / unreachable must be -1"
    assert ((path_edges[used] >= 0) & (path_edges[used] < num_edges)).all()
    safe = np.where(used, path_edges, num_edges).astype(np.int64)
    heads, tails = src[safe], dst[safe]
    rows = np.broadcast_to(np.arange(n)[:, None], (n, n))
    cols = np.broadcast_to(np.arange(n)[None, :], (n, n))
    assert (heads[..., 0][used[..., 0]] == rows[used[..., 0]]).all(), "path must start at i"
    assert (heads[..., 1:][used[..., 1:]] == tails[..., :-1][used[..., 1:]]).all(), "broken path"
    reached = spd[rows[..., None], tails]                               # spd(i, end of hop t)
    assert (reached[used] == np.broadcast_to(hops + 1, used.shape)[used]).all(), "not shortest"
    complete = (spd > 0) & (spd <= max_hops)
    last = np.take_along_axis(tails, np.clip(spd - 1, 0, max_hops - 1)[..., None], -1)[..., 0]
    assert (last[complete] == cols[complete]).all(), "untruncated path must end at j"


def symmetric_edge_index(num_nodes: int, pairs: np.ndarray, rng: np.random.Generator):
    """Both directions of each ``(u, v)`` pair, columns in a random order (random edge ids)."""
    pairs = pairs.reshape(-1, 2)
    both = np.concatenate([pairs, pairs[:, ::-1]])
    both = np.unique(both, axis=0)        # self-loops (u, u) appear once: their own reverse
    both = both[rng.permutation(len(both))]
    return np.ascontiguousarray(both.T, dtype=np.int64)


@st.composite
def random_graphs(draw, max_nodes: int = 256):
    """Single nodes, empty graphs, isolated nodes, several components, self-loops, dense bits."""
    num_nodes = draw(st.integers(1, max_nodes))
    num_pairs = draw(st.integers(0, 3 * num_nodes))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    # Restricting edges to a random "span" of node ids leaves isolated nodes and components.
    span = draw(st.integers(1, num_nodes))
    pairs = rng.integers(0, span, size=(num_pairs, 2))
    pairs = rng.permutation(num_nodes)[pairs]
    return num_nodes, symmetric_edge_index(num_nodes, pairs, rng)


def load_zinc(zinc_source, split):
    data = np.load(zinc_source / f"subset_{split}_graphs.npz")
    return data["node_ptr"], data["edge_index"], data["edge_ptr"]


# ----------------------------------------------------------------------------- correctness
@settings(FAST, max_examples=60)
@given(graph=random_graphs(), max_hops=st.integers(1, 8))
def test_distances_match_scipy_and_paths_are_shortest(graph, max_hops):
    num_nodes, edge_index = graph
    spd, path_edges = shortest_paths(num_nodes, edge_index, max_hops)
    assert spd.dtype == np.int16 and spd.shape == (num_nodes, num_nodes)
    assert path_edges.dtype == np.int16 and path_edges.shape == (num_nodes, num_nodes, max_hops)
    np.testing.assert_array_equal(spd, scipy_spd(num_nodes, edge_index))
    assert_valid_paths(spd, path_edges, edge_index)


@settings(FAST, max_examples=30)
@given(graph=random_graphs(max_nodes=64))
def test_distances_match_networkx(graph):
    num_nodes, edge_index = graph
    spd, _ = shortest_paths(num_nodes, edge_index, 3)
    nx_graph = nx.Graph()
    nx_graph.add_nodes_from(range(num_nodes))
    nx_graph.add_edges_from(edge_index.T.tolist())
    expected = np.full((num_nodes, num_nodes), UNREACHABLE)
    for i, lengths in nx.all_pairs_shortest_path_length(nx_graph):
        for j, d in lengths.items():
            expected[i, j] = d
    np.testing.assert_array_equal(spd, expected)


@settings(FAST, max_examples=60)
@given(graph=random_graphs(max_nodes=40), max_hops=st.integers(1, 6))
def test_path_choice_is_first_discovery_in_edge_id_order(graph, max_hops):
    num_nodes, edge_index = graph
    spd, path_edges = shortest_paths(num_nodes, edge_index, max_hops)
    ref_spd, ref_paths = reference_encoding(num_nodes, edge_index, max_hops)
    np.testing.assert_array_equal(spd, ref_spd)
    np.testing.assert_array_equal(path_edges, ref_paths)


@pytest.mark.parametrize("num_pairs", [64, 256, 1024, 8192])
def test_large_graphs_from_sparse_to_dense(num_pairs):
    # Hypothesis favours small graphs; N = 256 at fixed densities (many components .. dense).
    rng = np.random.default_rng(num_pairs)
    edge_index = symmetric_edge_index(256, rng.integers(0, 256, size=(num_pairs, 2)), rng)
    spd, path_edges = shortest_paths(256, edge_index, max_hops=4)
    np.testing.assert_array_equal(spd, scipy_spd(256, edge_index))
    assert_valid_paths(spd, path_edges, edge_index)


def test_path_through_node_zero_is_stored():
    # 1 - 0 - 2: Graphormer v1's Floyd-Warshall treated "via node 0" as "no intermediate node".
    edge_index = np.array([[1, 0, 0, 2], [0, 1, 2, 0]], dtype=np.int64)
    spd, path_edges = shortest_paths(3, edge_index, max_hops=3)
    assert spd[1, 2] == 2 and spd[2, 1] == 2
    assert path_edges[1, 2].tolist() == [0, 2, -1]      # 1 -> 0, then 0 -> 2
    assert path_edges[2, 1].tolist() == [3, 1, -1]      # 2 -> 0, then 0 -> 1


@pytest.mark.parametrize("first_neighbour", [1, 3])
def test_tie_broken_by_edge_id_order(first_neighbour):
    # Square 0-1-2-3-0: two shortest paths 0 -> 2; the neighbour whose edge comes first wins.
    other = 4 - first_neighbour
    undirected = [(0, first_neighbour), (0, other), (1, 2), (2, 3)]
    edge_index = np.array([[u for u, v in undirected] + [v for u, v in undirected],
                           [v for u, v in undirected] + [u for u, v in undirected]])
    _, path_edges = shortest_paths(4, edge_index, max_hops=2)
    first_hop, second_hop = path_edges[0, 2]
    assert edge_index[:, first_hop].tolist() == [0, first_neighbour]
    assert edge_index[:, second_hop].tolist() == [first_neighbour, 2]


def test_long_paths_are_truncated_to_max_hops():
    chain = np.array([[i, i + 1] for i in range(9)])                # 0 - 1 - ... - 9
    edge_index = np.ascontiguousarray(np.concatenate([chain, chain[:, ::-1]]).T)
    spd, path_edges = shortest_paths(10, edge_index, max_hops=3)
    assert spd[0, 9] == 9 and spd[9, 0] == 9
    assert path_edges[0, 9].tolist() == [0, 1, 2]                   # first three hops from 0
    assert path_edges[9, 0].tolist() == [17, 16, 15]                # 9 -> 8 -> 7 -> 6
    assert path_edges[0, 2].tolist() == [0, 1, -1]


def test_no_edges_and_isolated_nodes():
    spd, path_edges = shortest_paths(3, np.zeros((2, 0), dtype=np.int64), max_hops=2)
    assert spd.tolist() == [[0, -1, -1], [-1, 0, -1], [-1, -1, 0]]
    assert (path_edges == -1).all()
    spd, path_edges = shortest_paths(0, np.zeros((2, 0), dtype=np.int64), max_hops=2)
    assert spd.shape == (0, 0) and path_edges.shape == (0, 0, 2)


# ----------------------------------------------------------------------------- batching
@st.composite
def graph_batches(draw):
    graphs = draw(st.lists(random_graphs(max_nodes=30), min_size=1, max_size=8))
    # Empty graphs (0 nodes) are legal members of a batch.
    if draw(st.booleans()):
        graphs.insert(draw(st.integers(0, len(graphs))), (0, np.zeros((2, 0), dtype=np.int64)))
    node_ptr = np.cumsum([0] + [n for n, _ in graphs]).astype(np.int64)
    edge_ptr = np.cumsum([0] + [e.shape[1] for _, e in graphs]).astype(np.int64)
    edge_index = np.ascontiguousarray(np.concatenate([e for _, e in graphs], axis=1))
    return graphs, node_ptr, edge_index, edge_ptr


@settings(FAST, max_examples=40)
@given(batch=graph_batches(), max_hops=st.integers(1, 5))
def test_batched_equals_single_graph_calls(batch, max_hops):
    graphs, node_ptr, edge_index, edge_ptr = batch
    encoded = encode_graphs(node_ptr, edge_index, edge_ptr, max_hops)
    pair_ptr = encoded["pair_ptr"]
    assert pair_ptr.dtype == np.int64 and len(pair_ptr) == len(graphs) + 1
    assert encoded["degree"].dtype == encoded["spd"].dtype == encoded["path_edges"].dtype == np.int16
    np.testing.assert_array_equal(np.diff(pair_ptr), np.diff(node_ptr) ** 2)
    assert encoded["spd"].shape == (pair_ptr[-1],)
    assert encoded["path_edges"].shape == (pair_ptr[-1], max_hops)
    for g, (num_nodes, graph_edges) in enumerate(graphs):
        pairs = slice(pair_ptr[g], pair_ptr[g + 1])
        single_spd, single_paths = shortest_paths(num_nodes, graph_edges, max_hops)
        np.testing.assert_array_equal(encoded["spd"][pairs].reshape(num_nodes, num_nodes), single_spd)
        np.testing.assert_array_equal(encoded["path_edges"][pairs].reshape(single_paths.shape), single_paths)
        np.testing.assert_array_equal(encoded["degree"][node_ptr[g]:node_ptr[g + 1]],
                                      np.bincount(graph_edges[0], minlength=num_nodes))


# ----------------------------------------------------------------------------- real molecules
@pytest.mark.parametrize("split", ["val", "test"])
def test_real_zinc_graphs_match_scipy(zinc_source, split):
    node_ptr, edge_index, edge_ptr = load_zinc(zinc_source, split)
    encoded = encode_graphs(node_ptr, edge_index, edge_ptr, max_hops=5)
    pair_ptr = encoded["pair_ptr"]
    assert len(pair_ptr) == 1001
    for g in range(1000):
        num_nodes = int(node_ptr[g + 1] - node_ptr[g])
        local_edges = edge_index[:, edge_ptr[g]:edge_ptr[g + 1]]
        pairs = slice(pair_ptr[g], pair_ptr[g + 1])
        spd = encoded["spd"][pairs].reshape(num_nodes, num_nodes)
        path_edges = encoded["path_edges"][pairs].reshape(num_nodes, num_nodes, 5)
        degree = encoded["degree"][node_ptr[g]:node_ptr[g + 1]]
        np.testing.assert_array_equal(spd, scipy_spd(num_nodes, local_edges), err_msg=f"graph {g}")
        assert_valid_paths(spd, path_edges, local_edges)
        np.testing.assert_array_equal(degree, np.bincount(local_edges[0], minlength=num_nodes))
    assert (encoded["spd"] >= 0).all(), "ZINC molecules are connected"


def test_threads_give_identical_results(zinc_source):
    node_ptr, edge_index, edge_ptr = load_zinc(zinc_source, "test")
    one = encode_graphs(node_ptr, edge_index, edge_ptr, max_hops=5, num_threads=1)
    two = encode_graphs(node_ptr, edge_index, edge_ptr, max_hops=5, num_threads=2)
    for name in ("spd", "path_edges", "degree", "pair_ptr"):
        np.testing.assert_array_equal(one[name], two[name], err_msg=name)


def _encode_zinc_in_child(args):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        encoded = encode_graphs(*args, max_hops=5, num_threads=2)
    return encoded["spd"].tobytes(), [str(w.message) for w in caught]


def test_forked_child_falls_back_to_one_thread_instead_of_deadlocking(zinc_source):
    # libgomp deadlocks in a child forked after the parent ran a thread team (DataLoader workers).
    import multiprocessing

    args = load_zinc(zinc_source, "test")
    parent = encode_graphs(*args, max_hops=5, num_threads=2)
    with multiprocessing.get_context("fork").Pool(1) as pool:
        spd_bytes, warnings_seen = pool.apply_async(_encode_zinc_in_child, (args,)).get(timeout=60)
    assert spd_bytes == parent["spd"].tobytes()
    assert any("num_threads=1" in message for message in warnings_seen)


_FORK_AFTER_TORCH = """
import os, sys
import numpy as np
import torch
from graphormer_urpe.data.algos import encode_graphs

args = [np.load(sys.argv[1])[k] for k in ("node_ptr", "edge_index", "edge_ptr")]
torch.set_num_threads(2)
a = torch.randn(256, 256)
(a @ a).sum()  # torch's OpenMP team now exists in this (parent) process; the encoder never ran
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(read)
    spd = encode_graphs(*args, max_hops=5, num_threads=2)["spd"]
    os.write(write, spd.tobytes())
    os._exit(0)
os.close(write)
chunks = iter(lambda: os.read(read, 1 << 20), b"")
child_spd = b"".join(chunks)
os.waitpid(pid, 0)
assert child_spd == encode_graphs(*args, max_hops=5, num_threads=1)["spd"].tobytes(), "child differs"
print("child ok")
"""


def test_child_forked_after_a_torch_op_does_not_deadlock(zinc_source, tmp_path):
    # torch shares the encoder's libgomp: its thread team in the parent deadlocked the child's
    # first multi-threaded encode_graphs (a subprocess, so a hang fails here instead of hanging).
    import subprocess
    import sys

    node_ptr, edge_index, edge_ptr = load_zinc(zinc_source, "test")
    np.savez(tmp_path / "zinc.npz", node_ptr=node_ptr, edge_index=edge_index, edge_ptr=edge_ptr)
    try:
        done = subprocess.run([sys.executable, "-c", _FORK_AFTER_TORCH, str(tmp_path / "zinc.npz")],
                              capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("a child forked after a torch op deadlocked in encode_graphs(num_threads=2)")
    assert done.returncode == 0 and "child ok" in done.stdout, done.stderr
    assert "num_threads=1" in done.stderr


# ----------------------------------------------------------------------------- bad input
def _good():
    """Two graphs: 0 - 1 and the triangle 0 - 1 - 2."""
    return dict(
        node_ptr=np.array([0, 2, 5], dtype=np.int64),
        edge_index=np.array([[0, 1, 0, 1, 1, 2, 2, 0], [1, 0, 1, 0, 2, 1, 0, 2]], dtype=np.int64),
        edge_ptr=np.array([0, 2, 8], dtype=np.int64),
        max_hops=3,
    )


def _with(**changes):
    args = _good()
    args.update(changes)
    return args


def _edges_with(column, row, value):
    edge_index = _good()["edge_index"].copy()
    edge_index[row, column] = value
    return edge_index


BAD_INPUTS = {
    "node_ptr dtype": (_with(node_ptr=np.array([0, 2, 5], dtype=np.int32)), "node_ptr.*int64"),
    "edge_index dtype": (_with(edge_index=_good()["edge_index"].astype(np.float64)),
                         "edge_index.*int64"),
    "edge_index not contiguous": (_with(edge_index=np.asfortranarray(_good()["edge_index"])),
                                  "C-contiguous"),
    "edge_ptr strided": (_with(edge_ptr=np.array([0, 9, 2, 9, 8], dtype=np.int64)[::2]),
                         "edge_ptr.*C-contiguous"),
    "edge_index 3 rows": (_with(edge_index=np.zeros((3, 8), dtype=np.int64)), r"shape \[2, E\]"),
    "edge_index 1-D": (_with(edge_index=np.zeros(8, dtype=np.int64)), "edge_index must be 2-D"),
    "node_ptr 2-D": (_with(node_ptr=np.zeros((3, 1), dtype=np.int64)), "node_ptr must be 1-D"),
    "node_ptr empty": (_with(node_ptr=np.zeros(0, dtype=np.int64),
                             edge_ptr=np.zeros(0, dtype=np.int64)), "at least one entry"),
    "ptr length mismatch": (_with(edge_ptr=np.array([0, 8], dtype=np.int64)), "same length"),
    "edge_ptr end": (_with(edge_ptr=np.array([0, 2, 7], dtype=np.int64)), r"edge_ptr\[-1\] = 7"),
    "node_ptr start": (_with(node_ptr=np.array([1, 2, 5], dtype=np.int64)),
                       "node_ptr must start at 0"),
    "edge_ptr start": (_with(edge_ptr=np.array([1, 2, 8], dtype=np.int64)),
                       "edge_ptr must start at 0"),
    "node_ptr decreasing": (_with(node_ptr=np.array([0, 2, 1], dtype=np.int64)),
                            "node_ptr must be non-decreasing: graph 1"),
    "edge_ptr decreasing": (_with(edge_ptr=np.array([0, 9, 8], dtype=np.int64)),
                            "edge_ptr must be non-decreasing: graph 1"),
    "negative node id": (_with(edge_index=_edges_with(5, 1, -1)), "graph 1: .*node id -1"),
    "node id >= n_g": (_with(edge_index=_edges_with(4, 0, 3)), "graph 1: .*node id 3"),
    "global node id": (_with(edge_index=_edges_with(0, 1, 2)), "graph 0: .*LOCAL"),
    "huge node id": (_with(edge_index=_edges_with(1, 0, 2**62)), "graph 0: .*node id 4611686018427387904"),
    "too many nodes": (_with(node_ptr=np.array([0, 2, 2 + MAX_GRAPH_SIZE + 1], dtype=np.int64)),
                       f"graph 1 has {MAX_GRAPH_SIZE + 1} nodes"),
    "too many edges": (dict(node_ptr=np.array([0, 1], dtype=np.int64),
                            edge_index=np.zeros((2, MAX_GRAPH_SIZE + 1), dtype=np.int64),
                            edge_ptr=np.array([0, MAX_GRAPH_SIZE + 1], dtype=np.int64),
                            max_hops=2), f"graph 0 has {MAX_GRAPH_SIZE + 1} edges"),
    "asymmetric": (_with(edge_index=_edges_with(6, 1, 1)), "graph 1: edge_index column 7 has no reverse"),
    "max_hops 0": (_with(max_hops=0), "max_hops"),
    "max_hops too large": (_with(max_hops=MAX_HOPS_LIMIT + 1), "max_hops"),
}


@pytest.mark.parametrize("case", BAD_INPUTS, ids=list(BAD_INPUTS))
def test_bad_input_raises_value_error(case):
    args, message = BAD_INPUTS[case]
    with pytest.raises(ValueError, match=message):
        encode_graphs(**args)


@pytest.mark.parametrize("changes", [dict(max_hops=2.0), dict(max_hops=True), dict(max_hops="3"),
                                     dict(edge_index=[[0, 1], [1, 0]]), dict(num_threads=None)])
def test_wrong_types_raise_type_error(changes):
    with pytest.raises(TypeError):
        encode_graphs(**_with(**changes))


def test_num_threads_must_be_positive():
    with pytest.raises(ValueError, match="num_threads"):
        encode_graphs(**_with(num_threads=0))


def test_shortest_paths_rejects_bad_input():
    edge_index = np.array([[0, 1], [1, 0]], dtype=np.int64)
    with pytest.raises(ValueError, match="num_nodes"):
        shortest_paths(-1, edge_index, 2)
    with pytest.raises(ValueError, match="num_nodes"):
        shortest_paths(MAX_GRAPH_SIZE + 1, edge_index, 2)
    with pytest.raises(ValueError, match="graph 0: .*node id 1"):
        shortest_paths(1, edge_index, 2)
    with pytest.raises(ValueError, match="reverse"):
        shortest_paths(2, np.array([[0], [1]], dtype=np.int64), 2)
    with pytest.raises(TypeError, match="num_nodes"):
        shortest_paths(2.0, edge_index, 2)


# ----------------------------------------------------------------------------- fuzz
# Values chosen so that no fuzzed graph is both valid and huge (which would be a legitimate
# multi-GB allocation, not a bug): small ids, and extremes far apart from each other.
FUZZ_VALUES = st.one_of(st.integers(-3, 12), st.sampled_from(
    [2**20, 2**31 - 1, 2**31, 2**40, 2**62, 2**63 - 1, -(2**63), -(2**31)]))
FUZZ_DTYPES = st.sampled_from([np.int64, np.int64, np.int64, np.int32, np.uint64, np.int16,
                               np.float64, np.bool_, np.dtype(">i8")])


@st.composite
def fuzz_arrays(draw, max_size=12):
    ndim = draw(st.sampled_from([1, 1, 2, 2, 0, 3]))
    shape = tuple(draw(st.lists(st.integers(0, max_size), min_size=ndim, max_size=ndim)))
    if ndim == 2 and draw(st.booleans()):
        shape = (2, shape[1])
    values = draw(st.lists(FUZZ_VALUES, min_size=int(np.prod(shape)), max_size=int(np.prod(shape))))
    dtype = draw(FUZZ_DTYPES)
    with np.errstate(all="ignore"):
        array = np.array([int(v) % 2**64 for v in values], dtype=np.uint64).view(np.int64) \
            .reshape(shape).astype(dtype)
    layout = draw(st.sampled_from(["c", "c", "f", "strided"]))
    if layout == "f":
        array = np.asfortranarray(array)
    elif layout == "strided" and array.ndim >= 1:
        array = np.repeat(array, 2, axis=-1)[..., ::2]
    return array


@st.composite
def near_valid_batches(draw):
    """Mostly consistent batches with random ids: reaches the C validation and the encoder."""
    counts = draw(st.lists(st.integers(0, 6), min_size=0, max_size=4))
    edge_counts = draw(st.lists(st.integers(0, 8), min_size=len(counts), max_size=len(counts)))
    node_ptr = np.cumsum([0] + counts).astype(np.int64)
    edge_ptr = np.cumsum([0] + edge_counts).astype(np.int64)
    local_ids = st.integers(0, max(counts, default=0))             # mostly in range
    ids = draw(st.lists(st.one_of(local_ids, local_ids, local_ids, FUZZ_VALUES),
                        min_size=2 * int(edge_ptr[-1]), max_size=2 * int(edge_ptr[-1])))
    edge_index = np.array(ids, dtype=np.int64).reshape(2, -1)
    if draw(st.booleans()):                      # make it symmetric where possible
        edge_index = np.ascontiguousarray(np.concatenate(
            [edge_index[:, : edge_index.shape[1] // 2], edge_index[::-1, : edge_index.shape[1] // 2]],
            axis=1))
        edge_ptr = np.minimum(edge_ptr, edge_index.shape[1])
    if draw(st.integers(0, 3)) == 0:
        ptr, index, value = draw(st.sampled_from(["node", "edge"])), draw(st.integers(0, 4)), \
            draw(FUZZ_VALUES)
        target = node_ptr if ptr == "node" else edge_ptr
        target[min(index, len(target) - 1)] = value
    return node_ptr, edge_index, edge_ptr


def _call_both(node_ptr, edge_index, edge_ptr, max_hops, num_threads, num_nodes):
    for call in (lambda: encode_graphs(node_ptr, edge_index, edge_ptr, max_hops, num_threads),
                 lambda: shortest_paths(num_nodes, edge_index, max_hops)):
        try:
            result = call()
        except (ValueError, TypeError):
            continue
        # Anything accepted must be a well-formed encoding.
        spd = result["spd"] if isinstance(result, dict) else result[0]
        assert spd.dtype == np.int16


@settings(FAST, max_examples=300)
@given(node_ptr=fuzz_arrays(), edge_index=fuzz_arrays(), edge_ptr=fuzz_arrays(),
       max_hops=st.one_of(FUZZ_VALUES, st.floats(), st.none()), num_threads=st.integers(-1, 3),
       num_nodes=st.one_of(FUZZ_VALUES, st.floats()))
def test_fuzz_garbage_only_raises_value_or_type_error(node_ptr, edge_index, edge_ptr, max_hops,
                                                      num_threads, num_nodes):
    _call_both(node_ptr, edge_index, edge_ptr, max_hops, num_threads, num_nodes)


@settings(FAST, max_examples=300)
@given(batch=near_valid_batches(), max_hops=st.one_of(st.integers(1, 6), st.integers(-1, 300)), num_threads=st.integers(1, 2),
       num_nodes=st.integers(-2, 8))
def test_fuzz_near_valid_only_raises_value_or_type_error(batch, max_hops, num_threads, num_nodes):
    _call_both(*batch, max_hops, num_threads, num_nodes)


def test_encoder_source_has_no_negative_indices():
    """The extension is compiled with ``wraparound=False``: there some Cython versions hand
    ``a[-1]`` to numpy as a raw index, which raises IndexError, so the source
    indexes from the front only."""
    import io
    import tokenize
    from pathlib import Path

    source = (Path(__file__).resolve().parents[2] / "cython_ext" / "encoding.pyx").read_text()
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(source).readline)
              if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT)]
    negative = [a.start[0] for a, b in zip(tokens, tokens[1:]) if a.string == "[" and b.string == "-"]
    assert negative == [], f"negative indices on lines {negative} of cython_ext/encoding.pyx"

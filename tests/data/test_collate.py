"""Collation of flat encoded graphs into a padded GraphBatch, checked against a per-graph oracle
(networkx shortest paths) so the vectorised gathers are tested independently of the encoder."""
from __future__ import annotations

import networkx as nx
import numpy as np
import pytest
import torch

from graphormer_urpe.data.batch import collate
from graphormer_urpe.data.graphs import FlatGraphs
from graphormer_urpe.data.feature_ids import feature_offsets, num_embeddings, to_shared_ids

ATOM_DIMS, BOND_DIMS, K = [5, 3], [4, 2], 3


def _random_graph(rng: np.random.Generator, n: int):
    """A random undirected graph (maybe disconnected) as directed edges in both directions."""
    pairs = {tuple(sorted(p)) for p in rng.integers(0, n, size=(n, 2)) if p[0] != p[1]}
    edges = [(u, v) for u, v in sorted(pairs)] + [(v, u) for u, v in sorted(pairs)]
    edge_index = np.array(edges, dtype=np.int64).reshape(-1, 2).T
    x = np.stack([rng.integers(0, d, n) for d in ATOM_DIMS], 1)
    edge_attr = np.stack([rng.integers(0, d, edge_index.shape[1]) for d in BOND_DIMS], 1)
    return x, edge_index, edge_attr


def _oracle_encoding(n: int, edge_index: np.ndarray):
    """spd [n, n] and path_edges [n, n, K] (local edge ids of one shortest path) via networkx."""
    graph = nx.DiGraph()
    graph.add_nodes_from(range(n))
    edge_id = {}
    for e, (u, v) in enumerate(edge_index.T.tolist()):
        graph.add_edge(u, v)
        edge_id[(u, v)] = e
    spd = np.full((n, n), -1, np.int16)
    path_edges = np.full((n, n, K), -1, np.int16)
    for i, targets in nx.all_pairs_shortest_path(graph):
        for j, path in targets.items():
            spd[i, j] = len(path) - 1
            ids = [edge_id[(a, b)] for a, b in zip(path[:-1], path[1:])][:K]
            path_edges[i, j, :len(ids)] = ids
    degree = np.bincount(edge_index[0], minlength=n).astype(np.int16)
    return spd, path_edges, degree


@pytest.fixture(scope="module")
def flat_and_raw():
    rng = np.random.default_rng(0)
    sizes = [1, 7, 3, 12, 5, 9, 2]
    raw = [(_random_graph(rng, n), n) for n in sizes]
    enc = [_oracle_encoding(n, ei) for (_, ei, _), n in raw]
    y = rng.normal(size=(len(sizes), 2)).astype(np.float32)
    flat = FlatGraphs(
        x=to_shared_ids(np.concatenate([x for (x, _, _), _ in raw]), ATOM_DIMS),
        node_ptr=np.concatenate([[0], np.cumsum(sizes)]),
        edge_attr=to_shared_ids(np.concatenate([ea for (_, _, ea), _ in raw]), BOND_DIMS, "bond"),
        edge_ptr=np.concatenate([[0], np.cumsum([ei.shape[1] for (_, ei, _), _ in raw])]),
        y=y,
        pair_ptr=np.concatenate([[0], np.cumsum(np.square(sizes))]),
        encodings={"spd": np.concatenate([s.reshape(-1) for s, _, _ in enc]),
                   "path_edges": np.concatenate([p.reshape(-1, K) for _, p, _ in enc]),
                   "degree": np.concatenate([d for _, _, d in enc])},
    )
    return flat, raw, enc, y


def test_collate_matches_per_graph_oracle(flat_and_raw):
    flat, raw, enc, y = flat_and_raw
    order = [3, 0, 5, 5, 1]  # any order, repeats allowed
    batch = collate(flat, order)
    big_n = max(raw[g][1] for g in order)
    assert batch.x.shape == (5, big_n, 2) and batch.x.dtype == torch.int32
    assert batch.spd.shape == (5, big_n, big_n) and batch.spd.dtype == torch.int16
    assert batch.path_edges.shape == (5, big_n, big_n, K) and batch.path_edges.dtype == torch.int32
    assert batch.edge_attr.dtype == torch.int32 and batch.degree.dtype == torch.int16
    assert batch.edge_attr.shape == (sum(raw[g][0][1].shape[1] for g in order) + 1, 2)
    assert not batch.edge_attr[-1].any()
    assert batch.index.tolist() == order and batch.num_nodes.tolist() == [raw[g][1] for g in order]
    torch.testing.assert_close(batch.y, torch.from_numpy(y[order]))

    offsets = feature_offsets(ATOM_DIMS)
    bond_offsets = feature_offsets(BOND_DIMS)
    for b, g in enumerate(order):
        (x, edge_index, edge_attr), n = raw[g]
        spd, path_edges, degree = enc[g]
        assert np.array_equal(batch.x[b, :n].numpy(), x + offsets)
        assert not batch.x[b, n:].any()
        assert batch.node_mask[b].tolist() == [True] * n + [False] * (big_n - n)
        assert np.array_equal(batch.degree[b, :n].numpy(), degree) and not batch.degree[b, n:].any()
        assert np.array_equal(batch.spd[b, :n, :n].numpy(), spd)
        assert (batch.spd[b, n:] == -1).all() and (batch.spd[b, :, n:] == -1).all()
        assert (batch.path_edges[b, n:] == -1).all() and (batch.path_edges[b, :, n:] == -1).all()
        # Following path_edges into the batch's edge_attr must give the graph's own bond features
        # along the oracle path, and the zero row where the path has ended.
        gathered = batch.edge_attr[batch.path_edges[b, :n, :n].long()].numpy()  # [n, n, K, Fe]
        with_zero_row = np.vstack([edge_attr + bond_offsets, np.zeros((1, len(BOND_DIMS)), int)])
        expected = with_zero_row[path_edges]  # -1 -> the zero row
        assert np.array_equal(gathered, expected)


def test_collate_single_and_empty_edges(flat_and_raw):
    flat = flat_and_raw[0]
    batch = collate(flat, [0])  # one isolated node: no edges at all
    assert batch.x.shape == (1, 1, 2) and batch.edge_attr.shape == (1, 2)
    assert batch.spd.tolist() == [[[0]]] and (batch.path_edges == -1).all()


def test_collate_rejects_out_of_range_index(flat_and_raw):
    with pytest.raises(ValueError, match="graph indices"):
        collate(flat_and_raw[0], [0, len(flat_and_raw[0])])


def test_shared_ids_offset_columns_and_reject_out_of_vocab():
    assert num_embeddings([5, 3]) == 9
    assert to_shared_ids(np.array([[0, 0], [4, 2]]), [5, 3]).tolist() == [[1, 6], [5, 8]]
    with pytest.raises(ValueError, match="column 1"):
        to_shared_ids(np.array([[0, 3]]), [5, 3])


def test_flat_graphs_rejects_inconsistent_arrays(flat_and_raw):
    flat = flat_and_raw[0]
    with pytest.raises(ValueError, match="spd rows"):
        FlatGraphs(**{**flat.__dict__, "encodings": {**flat.encodings, "spd": flat.encodings["spd"][:-1]}})


def test_collate_pyg_graphs_on_real_zinc(zinc_source):
    """Encode + collate real ZINC test graphs: hop counts equal networkx's, path edges walk real
    bonds from i towards j, features land in the shared id space."""
    from torch_geometric.data import Data

    from graphormer_urpe.data.batch import collate_pyg_graphs
    from graphormer_urpe.data.featurize import ZINC_ATOM_FEATURE_DIMS, ZINC_BOND_FEATURE_DIMS

    arrays = np.load(zinc_source / "subset_test_graphs.npz")
    node_ptr, edge_ptr = arrays["node_ptr"], arrays["edge_ptr"]
    graphs = [Data(x=torch.from_numpy(arrays["x"][node_ptr[g]:node_ptr[g + 1]]),
                   edge_index=torch.from_numpy(arrays["edge_index"][:, edge_ptr[g]:edge_ptr[g + 1]]),
                   edge_attr=torch.from_numpy(arrays["edge_attr"][edge_ptr[g]:edge_ptr[g + 1]]),
                   y=torch.from_numpy(arrays["y"][g:g + 1])) for g in range(6)]
    batch = collate_pyg_graphs(graphs, K, ZINC_ATOM_FEATURE_DIMS, ZINC_BOND_FEATURE_DIMS)
    assert batch.x.shape[1] == max(d.num_nodes for d in graphs)
    torch.testing.assert_close(batch.y[:, 0], torch.from_numpy(arrays["y"][:6]))
    first_edge = 0
    for b, d in enumerate(graphs):
        n = d.num_nodes
        assert np.array_equal(batch.x[b, :n, 0].numpy(), d.x.numpy() + 1)
        graph = nx.Graph(d.edge_index.T.tolist())
        spd = dict(nx.all_pairs_shortest_path_length(graph))
        assert batch.spd[b, :n, :n].tolist() == [[spd[i][j] for j in range(n)] for i in range(n)]
        edges = d.edge_index.numpy()
        for i, j in [(0, n - 1), (n - 1, 0), (1, n // 2)]:
            rows = batch.path_edges[b, i, j]
            rows = rows[rows >= 0].numpy() - first_edge
            assert len(rows) == min(spd[i][j], K) and edges[0, rows[0]] == i
            assert all(edges[1, a] == edges[0, c] for a, c in zip(rows[:-1], rows[1:]))  # a walk
            assert np.array_equal(batch.edge_attr[rows + first_edge, 0].numpy(), d.edge_attr.numpy()[rows] + 1)
        first_edge += d.edge_index.shape[1]

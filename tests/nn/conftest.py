"""Real ZINC molecules (the official PyG test subset) as PyG ``Data`` and as a ``GraphBatch``."""
from __future__ import annotations

import numpy as np
import pytest
import torch

# ZINC vocabularies as the data layer builds them: 28 atom types, bond types 0..3 (1..3 occur).
ZINC_ATOM_DIMS = [28]
ZINC_BOND_DIMS = [4]
ZINC_MAX_HOPS = 5


@pytest.fixture(scope="session")
def zinc_graphs(zinc_source):
    """The first 64 graphs of ZINC-12k test as ``torch_geometric.data.Data``."""
    from torch_geometric.data import Data

    arrays = np.load(zinc_source / "subset_test_graphs.npz")
    node_ptr, edge_ptr = arrays["node_ptr"], arrays["edge_ptr"]
    graphs = []
    for g in range(64):
        nodes = slice(node_ptr[g], node_ptr[g + 1])
        edges = slice(edge_ptr[g], edge_ptr[g + 1])
        graphs.append(Data(
            x=torch.from_numpy(arrays["x"][nodes]),
            edge_index=torch.from_numpy(arrays["edge_index"][:, edges]),
            edge_attr=torch.from_numpy(arrays["edge_attr"][edges]),
            y=torch.from_numpy(arrays["y"][g:g + 1]),
        ))
    return graphs


@pytest.fixture(scope="session")
def zinc_collate():
    """``collate(list[Data]) -> GraphBatch`` with ZINC's vocabularies."""
    from graphormer_urpe.data.batch import collate_pyg_graphs

    def collate(graphs):
        return collate_pyg_graphs(graphs, ZINC_MAX_HOPS, ZINC_ATOM_DIMS, ZINC_BOND_DIMS)

    return collate


@pytest.fixture(scope="session")
def zinc_vocab():
    """``num_atom_embeddings`` / ``num_bond_embeddings`` for ZINC."""
    from graphormer_urpe.data.feature_ids import num_embeddings

    return {"num_atom_embeddings": num_embeddings(ZINC_ATOM_DIMS),
            "num_bond_embeddings": num_embeddings(ZINC_BOND_DIMS)}

"""DataModules over encoded graphs: facts for the model, loaders, order, max_nodes policy."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from graphormer_urpe.data.batch import GraphBatch
from graphormer_urpe.data import ZINCDataModule
from graphormer_urpe.data.datamodule import SMILESTableDataModule
from graphormer_urpe.data.batch import collate_pyg_graphs
from graphormer_urpe.data.featurize import ZINC_ATOM_FEATURE_DIMS, ZINC_BOND_FEATURE_DIMS, file_fingerprint

ESOL_TARGET = "measured log solubility in mols per litre"
from graphormer_urpe.data.zinc import load_zinc


def test_facts_linked_into_the_model():
    dm = ZINCDataModule(root="unused", max_hops=3)
    assert (dm.num_atom_embeddings, dm.num_bond_embeddings, dm.num_targets, dm.max_hops) == (29, 5, 1, 3)
    assert (dm.task, dm.featurizer) == ("regression", "zinc")
    with pytest.raises(ValueError, match="max_hops"):
        ZINCDataModule(max_hops=0)


def test_loaders_serve_every_graph_as_graph_batches(zinc_data_root):
    dm = ZINCDataModule(root=str(zinc_data_root), batch_size=512, eval_batch_size=300)
    dm.prepare_data()
    dm.setup("fit")
    seen = torch.cat([b.index for b in dm.train_dataloader()])
    assert sorted(seen.tolist()) == list(range(10_000))
    val = list(dm.val_dataloader())
    assert [len(b) for b in val] == [300, 300, 300, 100]
    assert torch.cat([b.index for b in val]).tolist() == list(range(1000))  # evaluation keeps order
    dm.setup("test")
    assert sum(len(b) for b in dm.test_dataloader()) == 1000
    assert sum(len(b) for b in dm.predict_dataloader()) == 1000


def test_batches_equal_collating_the_pyg_graphs_directly(zinc_data_root):
    dm = ZINCDataModule(root=str(zinc_data_root), max_hops=4, eval_batch_size=37)
    dm.setup("validate")
    batch = next(iter(dm.val_dataloader()))
    assert isinstance(batch, GraphBatch)
    dataset = load_zinc(zinc_data_root / "ZINC", subset=True, split="val")
    direct = collate_pyg_graphs([dataset[g] for g in range(37)], 4, ZINC_ATOM_FEATURE_DIMS, ZINC_BOND_FEATURE_DIMS)
    for name in ("x", "node_mask", "degree", "spd", "edge_attr", "path_edges", "y", "num_nodes", "index"):
        assert torch.equal(getattr(batch, name), getattr(direct, name)), name
    assert batch.x.shape[1] == int(batch.num_nodes.max())  # padded to the largest graph only


def test_training_order_is_a_function_of_seed_and_epoch(zinc_data_root):
    def first_batch(seed, epoch):
        dm = ZINCDataModule(root=str(zinc_data_root), batch_size=64, seed=seed)
        loader = dm.train_dataloader()
        loader.sampler.set_epoch(epoch)
        return next(iter(loader)).index.tolist()

    assert first_batch(0, 0) == first_batch(0, 0)
    assert first_batch(0, 1) != first_batch(0, 0)
    assert first_batch(1, 0) != first_batch(0, 0)


def test_max_nodes_drops_only_training_graphs(zinc_data_root, caplog):
    dm = ZINCDataModule(root=str(zinc_data_root), max_nodes=20, batch_size=1000, eval_batch_size=1000)
    dm.setup("fit")
    sizes = dm.splits["train"].num_nodes
    expected_dropped = int((sizes > 20).sum())
    assert 0 < expected_dropped < len(sizes)
    with caplog.at_level(logging.WARNING):
        train = torch.cat([b.num_nodes for b in dm.train_dataloader()])
    assert len(train) == len(sizes) - expected_dropped and int(train.max()) <= 20
    assert f"dropped {expected_dropped} of 10000 training graphs" in caplog.text
    val = torch.cat([b.num_nodes for b in dm.val_dataloader()])
    assert len(val) == 1000 and int(val.max()) > 20


def test_worker_processes_give_the_same_batches(zinc_data_root):
    dm = ZINCDataModule(root=str(zinc_data_root), eval_batch_size=250, num_workers=2)
    reference = ZINCDataModule(root=str(zinc_data_root), eval_batch_size=250)
    for a, b in zip(dm.val_dataloader(), reference.val_dataloader()):
        assert torch.equal(a.path_edges, b.path_edges) and torch.equal(a.index, b.index)
    assert np.array_equal(dm.splits["val"].y, reference.splits["val"].y)


class EveryOtherRow(SMILESTableDataModule):
    """The new-dataset example of docs/data.md on real ESOL: a source and a row split, nothing else."""

    def __init__(self, path: str, cache_root: str, batch_size: int = 64, **kwargs) -> None:
        super().__init__(batch_size=batch_size, **kwargs)
        self.path, self.cache_root = Path(path), Path(cache_root)
        self.reads = 0

    @property
    def num_targets(self) -> int:
        return 1

    def read(self):
        self.reads += 1
        table = pd.read_csv(self.path)
        return table["smiles"].tolist(), table[ESOL_TARGET].to_numpy(np.float32)

    def table_source(self):
        return self.cache_root, file_fingerprint(self.path), self.read

    def split_rows(self, graph_of_row, y):
        rows = np.flatnonzero(graph_of_row >= 0)
        return {"train": rows[0::2], "val": rows[1::2], "test": rows[1::2]}


def test_a_smiles_table_needs_only_its_source_and_splits(esol_csv, tmp_path):
    esol = esol_csv
    dm = EveryOtherRow(str(esol), str(tmp_path), max_hops=3, seed=2, build_workers=2, eval_batch_size=2000)
    assert (dm.batch_size, dm.max_hops, dm.seed, dm.featurizer, dm.num_atom_embeddings) == (64, 3, 2, "ogb", 175)
    dm.setup("fit")
    table = pd.read_csv(esol)
    val = next(iter(dm.val_dataloader()))
    assert val.index.tolist() == list(range(len(table) // 2))
    np.testing.assert_array_equal(val.y[:, 0].numpy(), table[ESOL_TARGET].to_numpy(np.float32)[1::2])
    assert val.path_edges.shape[-1] == 3 and dm.reads == 1
    train = [b for b in dm.train_dataloader()]
    assert sum(len(b) for b in train) == (len(table) + 1) // 2 and len(train[0]) == 64
    again = EveryOtherRow(str(esol), str(tmp_path), max_hops=3)
    again.setup("fit")  # featurized molecules and encodings load from the cache
    assert again.reads == 0 and len(again.val_dataloader().dataset) == len(table) // 2

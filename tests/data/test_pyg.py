"""The PyG route (graphormer_urpe/data/pyg.py) on the real ZINC: PyG's own ZINC dataset and
DataLoader with GraphormerEncodings give the same batch as the project's cached pipeline, and the
worked example of docs/pyg.md runs as written."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from torch_geometric.datasets import ZINC
from torch_geometric.loader import DataLoader

from graphormer_urpe.data import ZINCDataModule
from graphormer_urpe.data.batch import collate
from graphormer_urpe.data.featurize import ZINC_ATOM_FEATURE_DIMS, ZINC_BOND_FEATURE_DIMS
from graphormer_urpe.data.pyg import GraphormerEncodings, to_graph_batch

REPO = Path(__file__).resolve().parents[2]


def test_pyg_batches_equal_the_cached_pipelines(zinc_root, zinc_data_root):
    """Batches of the exact official ZINC validation graphs: every GraphBatch field is equal."""
    pyg = ZINC(str(zinc_root), subset=True, split="val", transform=GraphormerEncodings(max_hops=5))
    cached = ZINCDataModule(root=str(zinc_data_root), max_hops=5, encode_threads=1).load_split("val")
    for start, batch in zip((0, 100), DataLoader(pyg[:200], batch_size=100)):
        ours = to_graph_batch(batch, ZINC_ATOM_FEATURE_DIMS, ZINC_BOND_FEATURE_DIMS)
        reference = collate(cached.graphs, np.arange(start, start + 100))
        for field in ("x", "node_mask", "degree", "spd", "edge_attr", "path_edges", "y", "num_nodes"):
            assert torch.equal(getattr(ours, field), getattr(reference, field)), field


def test_to_graph_batch_names_what_is_missing_or_out_of_range(zinc_root):
    plain = ZINC(str(zinc_root), subset=True, split="val")
    batch = next(iter(DataLoader(plain[:4], batch_size=4)))
    with pytest.raises(ValueError, match=r"no \['degree', 'spd', 'path_edges'\]: add GraphormerEncodings"):
        to_graph_batch(batch, ZINC_ATOM_FEATURE_DIMS, ZINC_BOND_FEATURE_DIMS)
    encoded = next(iter(DataLoader(ZINC(str(zinc_root), subset=True, split="val",
                                        transform=GraphormerEncodings())[:4], batch_size=4)))
    with pytest.raises(ValueError, match=r"atom feature column 0 has values in \[0, \d+\], outside its vocabulary \[0, 5\)"):
        to_graph_batch(encoded, (5,), ZINC_BOND_FEATURE_DIMS)


def test_docs_worked_example_trains_on_real_zinc(zinc_root, tmp_path, monkeypatch, one_torch_thread):
    """docs/pyg.md's code block, as written, with PyG's ZINC processed from the real raw files."""
    text = (REPO / "docs" / "pyg.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    root = tmp_path / "ZINC"
    root.mkdir()
    (root / "raw").symlink_to(Path(zinc_root) / "raw", target_is_directory=True)
    monkeypatch.setenv("PYG_ZINC_ROOT", str(root))
    monkeypatch.setenv("PYG_EXAMPLE_STEPS", "60")
    namespace: dict = {}
    exec(compile(code, "docs/pyg.md", "exec"), namespace)
    assert namespace["step"] == 60
    val = namespace["val"]
    assert "path_edges" in val[0] and val[0].spd.shape == (val[0].num_nodes ** 2,)
    targets = torch.cat([d.y for d in val])
    baseline = (targets - torch.cat([d.y for d in namespace["train"]]).mean()).abs().mean().item()
    assert np.isfinite(namespace["val_mae"]) and namespace["val_mae"] < baseline


@pytest.mark.parametrize("graph", ["float x", "NaN in x", "float edge_attr", "no edge_attr"])
def test_transform_refuses_features_that_are_not_integer_ids(zinc_root, graph):
    """Real ZINC graphs whose features cannot be embedded: refused by name when the transform
    runs, not truncated to ids (NaN included) or failing later inside the batching."""
    data = ZINC(str(zinc_root), subset=True, split="val")[0]
    if graph == "float x":
        data.x = data.x.float() + 0.5
    elif graph == "NaN in x":
        data.x = data.x.float()
        data.x[0] = float("nan")
    elif graph == "float edge_attr":
        data.edge_attr = data.edge_attr.float()
    else:
        del data.edge_attr
    message = {"float x": r"atom \(x\) features are float32, not integers",
               "NaN in x": r"atom \(x\) features are float32, not integers",
               "float edge_attr": r"bond \(edge_attr\) features are float32, not integers",
               "no edge_attr": "the graph has no edge_attr: Graphormer embeds integer bond features"}[graph]
    with pytest.raises(ValueError, match=message):
        GraphormerEncodings(max_hops=5)(data)

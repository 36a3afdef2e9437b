"""The molecule readout (``GraphormerConfig.readout``): what the output head reads of the final
states. A sum of atom vectors can add; the graph token alone (a softmax-weighted mean) cannot."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from graphormer_urpe.data.facts import DataFacts
from graphormer_urpe.nn.graphormer import Graphormer, GraphormerConfig

TINY = dict(num_layers=2, hidden_dim=16, ffn_dim=16, num_heads=2, attention_dropout=0.0,
            activation_dropout=0.0)


@pytest.fixture(scope="module")
def additive_sets(zinc_source, zinc_collate):
    """Real ZINC molecules (the exact official val and test graphs) with an additive target,
    a fixed random contribution per atom type summed over the atoms: the small ones (at most 16
    atoms) to train on, the large ones (at least 30, about twice their size) to predict."""
    from torch_geometric.data import Data

    graphs = []
    for split in ("val", "test"):
        arrays = np.load(zinc_source / f"subset_{split}_graphs.npz")
        node_ptr, edge_ptr = arrays["node_ptr"], arrays["edge_ptr"]
        for g in range(len(node_ptr) - 1):
            nodes, edges = slice(node_ptr[g], node_ptr[g + 1]), slice(edge_ptr[g], edge_ptr[g + 1])
            graphs.append(Data(x=torch.from_numpy(arrays["x"][nodes]),
                               edge_index=torch.from_numpy(arrays["edge_index"][:, edges]),
                               edge_attr=torch.from_numpy(arrays["edge_attr"][edges])))
    contribution = np.random.default_rng(0).normal(size=64)
    for graph in graphs:
        graph.y = torch.tensor([[float(contribution[graph.x.view(-1).numpy()].sum())]])
    small = [g for g in graphs if g.num_nodes <= 16]
    large = [g for g in graphs if g.num_nodes >= 30]
    assert len(small) > 100 and len(large) > 100
    assert np.mean([g.num_nodes for g in large]) > 2 * np.mean([g.num_nodes for g in small])
    return ((zinc_collate(small), torch.cat([g.y for g in small])),
            (zinc_collate(large), torch.cat([g.y for g in large])))


def _trained(readout: str, batch, y, zinc_vocab, steps: int = 200) -> Graphormer:
    torch.manual_seed(0)
    model = Graphormer.from_preset("slim", **zinc_vocab, **TINY, readout=readout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.0)
    for _ in range(steps):
        loss = torch.nn.functional.l1_loss(model(batch), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def test_a_readout_that_adds_predicts_an_additive_target_on_molecules_twice_the_size(
        additive_sets, zinc_vocab):
    (small, y_small), (large, y_large) = additive_sets
    errors = {}
    for readout in ("token", "token+sum"):
        model = _trained(readout, small, y_small, zinc_vocab)
        with torch.no_grad():
            errors[readout] = ((model(small) - y_small).abs().mean().item(),
                               (model(large) - y_large).abs().mean().item())
    spread = y_large.std().item()
    # Both fit the small molecules; only the sum carries the target to the large ones.
    assert errors["token"][0] < 0.2 * spread and errors["token+sum"][0] < 0.2 * spread, errors
    assert errors["token+sum"][1] < 0.25 * spread, errors
    assert errors["token+sum"][1] < 0.4 * errors["token"][1], errors


@pytest.mark.parametrize("readout,width", [("token", 1), ("sum", 1), ("token+sum", 2)])
def test_the_head_reads_the_readout(zinc_graphs, zinc_collate, zinc_vocab, readout, width):
    """``forward`` is the head applied to ``embed``; ``embed_atoms`` gives the same readout with
    the atom vectors it was summed from (zero at padding), in one pass."""
    torch.manual_seed(0)
    model = Graphormer.from_preset("slim", **zinc_vocab, **TINY, readout=readout).eval()
    batch = zinc_collate(zinc_graphs[:8])
    with torch.no_grad():
        graph = model.embed(batch)
        also, atoms = model.embed_atoms(batch)
        assert graph.shape == (8, width * TINY["hidden_dim"]) == (8, model.readout_width)
        torch.testing.assert_close(model(batch), model.head(graph))
        torch.testing.assert_close(also, graph)
        assert atoms[~batch.node_mask].abs().max() == 0
        if readout != "token":
            torch.testing.assert_close(graph[:, -TINY["hidden_dim"]:], atoms.sum(dim=1))


def test_an_unknown_readout_is_refused_naming_the_choices(zinc_vocab):
    with pytest.raises(ValueError, match=r"readout must be one of \['token', 'sum', 'token\+sum'\], got 'mean'"):
        Graphormer.from_preset("slim", **zinc_vocab, **TINY, readout="mean")


def test_the_shipped_backbone_starts_a_model_that_adds_with_a_new_head(zinc_vocab):
    """``pretrained:zinc-descriptors`` (read with a token readout) loads into the same
    architecture with ``readout: token+sum``: every backbone tensor, the head re-initialised."""
    from graphormer_urpe.training.finetune import fit_state, read_backbone_state

    state, hparams = read_backbone_state("pretrained:zinc-descriptors")
    assert hparams["backbone"].get("readout", "token") == "token"
    config = GraphormerConfig.from_dict({**hparams["backbone"], "readout": "token+sum"})
    model = Graphormer(config.over(GraphormerConfig.preset(hparams["preset"])),
                       DataFacts(**{**hparams["facts"], "num_targets": 1}))
    fitted, reason = fit_state(model, state, hparams, "regression", reinit_head=False, source="shipped")
    assert reason is not None and "head" in reason
    model.load_state_dict(fitted)
    for name, tensor in state.items():
        if not name.startswith("head."):
            assert torch.equal(model.state_dict()[name], tensor), name
    assert model.head.weight.shape[1] == 2 * config.hidden_dim

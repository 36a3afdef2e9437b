"""The Graphormer backbone on real ZINC molecules: exactness, invariances, padding, parameters."""
from __future__ import annotations

import dataclasses

import networkx as nx
import pytest
import torch

from graphormer_urpe.data.batch import GraphBatch
from graphormer_urpe.data.facts import DataFacts
from graphormer_urpe.nn import PRESETS, Graphormer, GraphormerConfig, count_parameters

SMALL = dict(num_layers=3, hidden_dim=32, ffn_dim=32, num_heads=4)


def _model(zinc_vocab, seed=0, **kwargs) -> Graphormer:
    torch.manual_seed(seed)
    return Graphormer.from_preset("slim", **zinc_vocab, **{**SMALL, **kwargs})


def _randomise_scales(model: Graphormer, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for scale in model.urpe_scales:
            scale.delta.copy_(torch.rand(scale.delta.shape, generator=gen) - 0.5)


@pytest.fixture(scope="module")
def batch(zinc_graphs, zinc_collate):
    return zinc_collate(zinc_graphs[:16])


@pytest.mark.parametrize("train", [False, True])
def test_urpe_with_unit_scale_is_exactly_rpe(zinc_vocab, batch, train):
    urpe = _model(zinc_vocab, attention="urpe")
    rpe = _model(zinc_vocab, seed=123, attention="rpe")  # different init, then loaded
    missing, unexpected = urpe.load_state_dict(rpe.state_dict(), strict=False)
    assert not unexpected and missing and all(k.startswith("urpe_scales.") for k in missing)
    urpe.train(train), rpe.train(train)
    torch.manual_seed(7)
    out_urpe = urpe(batch)
    torch.manual_seed(7)  # same dropout masks
    out_rpe = rpe(batch)
    assert torch.equal(out_urpe, out_rpe)

    _randomise_scales(urpe)
    torch.manual_seed(7)
    assert not torch.allclose(urpe(batch), out_rpe, atol=1e-4), "C must reach the output"


@pytest.mark.parametrize("share", [False, True])
def test_urpe_scale_tables_are_the_effective_c_in_distance_slot_layout(zinc_vocab, batch, share):
    model = _model(zinc_vocab, share_urpe_scale=share, max_spd=6)
    tables = model.urpe_scale_tables()
    assert tables.dtype == torch.float32 and tables.shape == (SMALL["num_layers"], 6 + 3, 4)
    assert torch.equal(tables, torch.ones_like(tables))  # a fresh model: C = 1
    _randomise_scales(model)
    tables = model.urpe_scale_tables()
    # Row d of the table is what attention between two nodes at distance d is scaled by.
    _, scales = model.attention_inputs(batch)
    spd = batch.spd.long()
    g, i, j = torch.nonzero((spd >= 0) & (spd <= 6))[-1].tolist()
    for layer, scale in enumerate(scales):
        torch.testing.assert_close(scale[g, :, i + 1, j + 1], tables[layer, spd[g, i, j]],
                                   rtol=0, atol=0)
        torch.testing.assert_close(scale[g, :, 0, j + 1], tables[layer, 6 + 2], rtol=0, atol=0)
    assert share == bool(torch.equal(tables[0], tables[1]))
    rpe = _model(zinc_vocab, attention="rpe", max_spd=6).urpe_scale_tables()
    assert torch.equal(rpe, torch.ones(SMALL["num_layers"], 9, 4))


def _permute_nodes(batch: GraphBatch, perm: torch.Tensor, edge_perm: torch.Tensor) -> GraphBatch:
    """Relabel the padded node axis by ``perm`` (padding moves into the middle too) and reorder
    the real edge rows by ``edge_perm`` (path edge ids follow)."""
    new_row = torch.empty_like(edge_perm)
    new_row[edge_perm] = torch.arange(edge_perm.numel())
    remap = torch.cat([new_row, torch.tensor([edge_perm.numel()])]).to(torch.int32)
    path = batch.path_edges[:, perm][:, :, perm]
    num_edge_rows = batch.edge_attr.shape[0]
    path = torch.where(path >= 0, remap[path.long() % num_edge_rows], path)
    return dataclasses.replace(
        batch,
        x=batch.x[:, perm], node_mask=batch.node_mask[:, perm],
        encodings={"degree": batch.degree[:, perm], "spd": batch.spd[:, perm][:, :, perm], "path_edges": path},
        edge_attr=torch.cat([batch.edge_attr[:-1][edge_perm], batch.edge_attr[-1:]]),
    )


@pytest.mark.parametrize("attention", ["urpe", "rpe", "none"])
def test_model_is_invariant_to_node_and_edge_order(zinc_vocab, batch, attention):
    model = _model(zinc_vocab, attention=attention).eval()
    if attention == "urpe":
        _randomise_scales(model)
    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(batch.node_mask.shape[1], generator=gen)
    edge_perm = torch.randperm(batch.edge_attr.shape[0] - 1, generator=gen)
    permuted = _permute_nodes(batch, perm, edge_perm)
    assert not torch.equal(permuted.node_mask, batch.node_mask)
    torch.testing.assert_close(model(permuted), model(batch), rtol=1e-5, atol=1e-5)


def _unambiguous_paths(data, max_hops: int) -> bool:
    """True when, for every pair, all shortest paths carry the same bond types on their first
    ``max_hops`` hops: then Graphormer's one-path edge encoding does not depend on atom order."""
    g = nx.Graph()
    g.add_nodes_from(range(data.num_nodes))
    for (u, v), bond in zip(data.edge_index.t().tolist(), data.edge_attr.tolist()):
        g.add_edge(u, v, bond=bond)
    for s in g:
        for t in g:
            if s < t:
                seqs = {tuple(g[p[i]][p[i + 1]]["bond"] for i in range(len(p) - 1))[:max_hops]
                        for p in nx.all_shortest_paths(g, s, t)}
                if len(seqs) > 1:
                    return False
    return True


def test_molecule_relabelling_end_to_end(zinc_vocab, zinc_graphs, zinc_collate):
    """Permute atoms and bonds of real molecules, re-encode, re-collate: same predictions.

    Only molecules whose shortest paths are unambiguous qualify: with several shortest paths
    of different bond sequences (e.g. across a Kekulé benzene ring) the encoder picks one by
    atom order, as Graphormer does, and the edge encoding may change with it.
    """
    molecules = [d for d in zinc_graphs if _unambiguous_paths(d, 5)][:8]
    assert len(molecules) >= 4
    gen = torch.Generator().manual_seed(0)
    relabelled = []
    for d in molecules:
        perm = torch.randperm(d.num_nodes, generator=gen)  # new atom k = old atom perm[k]
        new_id = torch.empty_like(perm)
        new_id[perm] = torch.arange(d.num_nodes)
        edge_perm = torch.randperm(d.edge_index.shape[1], generator=gen)
        relabelled.append(d.__class__(x=d.x[perm], edge_index=new_id[d.edge_index[:, edge_perm]],
                                      edge_attr=d.edge_attr[edge_perm], y=d.y))
    model = _model(zinc_vocab).eval()
    _randomise_scales(model)
    torch.testing.assert_close(model(zinc_collate(relabelled)), model(zinc_collate(molecules)),
                               rtol=1e-5, atol=1e-5)


def test_prediction_does_not_depend_on_batch_padding(zinc_vocab, zinc_graphs, zinc_collate):
    sizes = [int(d.num_nodes) for d in zinc_graphs]
    small = min(range(len(sizes)), key=sizes.__getitem__)
    larger = sorted(range(len(sizes)), key=sizes.__getitem__)[-3:]
    model = _model(zinc_vocab).eval()
    _randomise_scales(model)
    alone = model(zinc_collate([zinc_graphs[small]]))
    in_batch = model(zinc_collate([zinc_graphs[larger[0]], zinc_graphs[small],
                                   zinc_graphs[larger[1]], zinc_graphs[larger[2]]]))
    assert sizes[larger[0]] > sizes[small] + 5
    torch.testing.assert_close(in_batch[1:2], alone, rtol=0, atol=1e-5)


def _written_out_forward(model: Graphormer, batch: GraphBatch) -> torch.Tensor:
    """Graphormer's forward with every layer's attention written out op by op, C looked up per
    layer from :meth:`Graphormer.urpe_scale_tables` and the padding mask applied in each layer."""
    from graphormer_urpe.nn.encodings import distance_slots

    nodes = model.atom_encoder(batch.x) + model.degree_encoder(batch.degree, batch.node_mask)
    h = model.graph_token(nodes)
    mask = torch.cat([torch.zeros_like(batch.node_mask[:, :1]), ~batch.node_mask], dim=1)
    slots = distance_slots(batch.spd, model.max_spd).long()
    node_bias = model.spatial_bias(slots) + model.edge_bias(batch.edge_attr, batch.path_edges)
    bias = model.virtual_distance(node_bias)
    scale_slots = torch.nn.functional.pad(slots, (1, 0, 1, 0), value=model.max_spd + 2)
    for layer, table in zip(model.layers, model.urpe_scale_tables()):
        attn, (b, n1, d) = layer.attn, h.shape
        q, k, v = attn.in_proj(layer.attn_norm(h)).view(b, n1, 3, attn.num_heads, -1).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / attn.head_dim ** 0.5 + bias
        scores = scores.masked_fill(mask[:, None, None], float("-inf"))
        probs = torch.softmax(scores, -1) * table[scale_slots].permute(0, 3, 1, 2)
        h = h + attn.out_proj((probs @ v).transpose(1, 2).reshape(b, n1, d))
        h = h + layer.ffn(layer.ffn_norm(h))
    return model.head(model.final_norm(h[:, 0]))


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("mode", ["autograd", "no_grad", "inference_mode"])
def test_forward_is_the_written_out_model_on_zinc(zinc_vocab, zinc_graphs, zinc_collate, share, mode):
    """The inference shortcuts (padding masked once in B, each layer's C looked up when reached,
    in-place steps) give the written-out model's predictions on 64 real ZINC molecules."""
    model = _model(zinc_vocab, share_urpe_scale=share).eval()
    _randomise_scales(model)
    batch = zinc_collate(zinc_graphs)
    assert not batch.node_mask.all(), "the batch must contain padding"
    with torch.no_grad():
        expected = _written_out_forward(model, batch)
    context = {"autograd": torch.enable_grad, "no_grad": torch.no_grad,
               "inference_mode": torch.inference_mode}[mode]
    with context():
        out = model(batch)
    torch.testing.assert_close(out.detach(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("share", [False, True])
def test_gradient_reaches_every_urpe_scale(zinc_vocab, batch, share):
    model = _model(zinc_vocab, share_urpe_scale=share)
    assert len(model.urpe_scales) == (1 if share else SMALL["num_layers"])
    torch.nn.functional.l1_loss(model(batch), batch.y).backward()
    for scale in model.urpe_scales:
        assert scale.delta.grad is not None and scale.delta.grad.abs().sum() > 0
    no_grad = [n for n, p in model.named_parameters() if p.grad is None]
    assert not no_grad, f"parameters outside the graph: {no_grad}"


def test_bf16_autocast_forward_and_backward(zinc_vocab, batch):
    model = _model(zinc_vocab).eval()
    _randomise_scales(model)
    reference = model(batch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(batch)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), reference, rtol=0.05, atol=0.05)
    out.float().sum().backward()
    assert model.urpe_scales[0].delta.grad.dtype == torch.float32
    assert model.urpe_scales[0].delta.grad.abs().sum() > 0


def test_sdpa_kernel_matches_eager_for_rpe(zinc_vocab, batch):
    eager = _model(zinc_vocab, attention="rpe").eval()
    fused = _model(zinc_vocab, attention="rpe", attention_impl="sdpa").eval()
    fused.load_state_dict(eager.state_dict())
    torch.testing.assert_close(fused(batch), eager(batch), rtol=1e-5, atol=1e-5)


def test_bad_configuration_and_input_raise_value_error(zinc_vocab, batch):
    with pytest.raises(ValueError, match="attention must be"):
        _model(zinc_vocab, attention="urpe2")
    with pytest.raises(ValueError, match="sdpa"):
        _model(zinc_vocab, attention="urpe", attention_impl="sdpa")
    with pytest.raises(ValueError, match="num_atom_embeddings"):
        Graphormer.from_preset("slim", num_bond_embeddings=5)
    with pytest.raises(ValueError, match="unknown preset"):
        Graphormer.from_preset("huge", **zinc_vocab)
    with pytest.raises(ValueError, match="task"):
        Graphormer(GraphormerConfig(), DataFacts(**zinc_vocab, task="ranking"))
    with pytest.raises(ValueError, match="num_targets must be >= 1"):
        Graphormer(GraphormerConfig(), DataFacts(**zinc_vocab, num_targets=0))
    with pytest.raises(ValueError, match="unknown Graphormer arguments"):
        Graphormer.from_preset("slim", **zinc_vocab, hidden_size=64)
    model = _model(zinc_vocab)
    with pytest.raises(ValueError, match="atom ids"):
        model(dataclasses.replace(batch, x=batch.x + zinc_vocab["num_atom_embeddings"]))
    with pytest.raises(ValueError, match="bond ids"):
        model(dataclasses.replace(batch, edge_attr=batch.edge_attr * 9))
    with pytest.raises(ValueError, match="spd"):
        model(dataclasses.replace(batch, encodings={**batch.encodings, "spd": batch.spd[:, :-1]}))


def test_the_data_must_carry_the_models_encodings(zinc_vocab, batch):
    """Model and data disagreeing on an encoding parameter is an error naming both, not a silent
    cut (before: the edge encoding read ``min(max_hops, K)`` hops)."""
    k = batch.path_edges.shape[-1]
    with pytest.raises(ValueError, match=f"path_edges hold {k} hops but the model's max_hops is {k + 1}"):
        _model(zinc_vocab, max_hops=k + 1)(batch)
    with pytest.raises(ValueError, match=f"path_edges hold {k - 1} hops but the model's max_hops is {k}"):
        _model(zinc_vocab, max_hops=k)(dataclasses.replace(
            batch, encodings={**batch.encodings, "path_edges": batch.path_edges[..., :-1]}))
    with pytest.raises(ValueError, match=r"model reads \['degree', 'path_edges', 'rwse', 'spd'\]"):
        _model(zinc_vocab, max_hops=k, node_encodings={"rwse": 3})(batch)
    rwse = torch.rand(*batch.node_mask.shape, 3)
    with pytest.raises(ValueError, match=r"the batch's rwse is \[.*, 3\] but the model embeds \[B, N, 4\]"):
        _model(zinc_vocab, max_hops=k, node_encodings={"rwse": 4})(
            dataclasses.replace(batch, encodings={**batch.encodings, "rwse": rwse}))
    with pytest.raises(ValueError, match="carries encodings .*'rwse'.* but the model reads"):
        _model(zinc_vocab, max_hops=k)(dataclasses.replace(batch, encodings={**batch.encodings, "rwse": rwse}))


def test_presets_and_code_defaults():
    """A config's unset fields are ``slim``'s; ``from_preset`` builds exactly the preset, its
    keyword arguments split between the architecture and the data's facts."""
    facts = DataFacts(num_atom_embeddings=29, num_bond_embeddings=5)
    model = Graphormer(GraphormerConfig(), facts)
    slim = Graphormer.from_preset("slim", num_atom_embeddings=29, num_bond_embeddings=5)
    assert model.config == slim.config == PRESETS["slim"] and model.facts == slim.facts == facts
    assert count_parameters(model) == count_parameters(slim)
    rpe = Graphormer.from_preset("small", num_atom_embeddings=29, num_bond_embeddings=5,
                                 attention="rpe", max_hops=3, num_targets=4, task="multiclass")
    assert rpe.config == dataclasses.replace(PRESETS["small"], attention="rpe")
    assert (rpe.facts.max_hops, rpe.head.out_features, rpe.edge_bias.max_hops) == (3, 4, 3)
    sizes = {name: (p.num_layers, p.hidden_dim, p.ffn_dim, p.num_heads)
             for name, p in PRESETS.items()}
    assert sizes == {"slim": (12, 80, 80, 8), "small": (6, 512, 512, 32),
                     "base": (12, 768, 768, 32)}
    for preset in PRESETS.values():  # every preset is complete: nothing left to a default
        assert None not in dataclasses.astuple(preset)
    assert (PRESETS["small"].dropout, PRESETS["small"].attention_dropout,
            PRESETS["small"].activation_dropout) == (0.1, 0.1, 0.0)


def test_backbone_config_merges_partial_overrides_and_names_valid_keys():
    config = GraphormerConfig(num_layers=4).over(GraphormerConfig(attention="rpe").over(PRESETS["slim"]))
    assert (config.num_layers, config.attention, config.hidden_dim) == (4, "rpe", 80)
    with pytest.raises(ValueError, match=r"unknown backbone keys \['layers'\]; valid keys: \['num_layers'"):
        GraphormerConfig.from_dict({"layers": 4})


def _graphormer_v1_count(atoms, bonds, degree_rows, spatial_rows, hop_rows, layers, d, ffn,
                         heads, targets=1) -> int:
    """Parameters of Graphormer v1's ``model.py`` (graph token, virtual distance, atom / in- /
    out-degree / edge / spatial / edge-distance tables, pre-LN layers, final LN, head)."""
    tables = atoms * d + 2 * degree_rows * d + bonds * heads + spatial_rows * heads
    tables += hop_rows * heads * heads + d + heads
    layer = 2 * 2 * d + 4 * (d * d + d) + (d * ffn + ffn) + (ffn * d + d)
    return tables + layers * layer + 2 * d + d * targets + targets


def test_parameter_counts_against_graphormer_v1(capsys):
    # Graphormer v1 ZINC tables: atom 64, edge 64, in/out degree 64, spatial 40, edge_dis 40.
    v1 = _graphormer_v1_count(64, 64, 64, 40, 40, 12, 80, 80, 8)
    same_tables = Graphormer.from_preset("slim", num_atom_embeddings=64, num_bond_embeddings=64,
                                         attention="rpe", max_degree=62, max_spd=38, max_hops=40)
    # Our single degree table replaces v1's in- + out-degree tables (always equal on molecules).
    assert count_parameters(same_tables) == v1 - 64 * 80

    # configs/zinc.yaml: the ZINC vocabulary (29 atom, 5 bond ids) and v1's 20 hops.
    zinc = {"num_atom_embeddings": 29, "num_bond_embeddings": 5, "max_hops": 20}
    counts = {
        f"slim/{att}{'/shared' if share else ''}": count_parameters(
            Graphormer.from_preset("slim", **zinc, attention=att, share_urpe_scale=share))
        for att, share in [("rpe", False), ("urpe", False), ("urpe", True), ("none", False)]
    }
    # v1's minus its out-degree table and the table rows our ids never reach.
    assert counts["slim/rpe"] == v1 - 64 * 80 - (64 - 29) * 80 - (64 - 5) * 8 - (40 - 20) * 8 * 8
    c_rows = PRESETS["slim"].max_spd + 3
    assert counts["slim/urpe"] - counts["slim/rpe"] == 12 * 8 * c_rows
    assert counts["slim/urpe/shared"] - counts["slim/rpe"] == 8 * c_rows

    from graphormer_urpe.data.feature_ids import num_embeddings
    from ogb.utils.features import get_atom_feature_dims, get_bond_feature_dims
    ogb = {"num_atom_embeddings": num_embeddings(get_atom_feature_dims()),
           "num_bond_embeddings": num_embeddings(get_bond_feature_dims())}
    for att in ("rpe", "urpe"):
        counts[f"base/{att}"] = count_parameters(Graphormer.from_preset("base", **ogb, attention=att))
    with capsys.disabled():
        print("\nparameter counts (ZINC vocab 29/5 and 20 hops for slim, OGB vocab "
              f"{ogb['num_atom_embeddings']}/{ogb['num_bond_embeddings']} for base):")
        for name, count in counts.items():
            print(f"  {name:18s} {count:>11,d}")
        print(f"  v1 code, ZINC     {v1:>11,d}  (paper: 489,321 Graphormer, 491,737 + URPE)")

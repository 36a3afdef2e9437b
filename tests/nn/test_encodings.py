"""Graphormer's encodings against direct, loop-level readings of their formulas on real ZINC."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphormer_urpe.nn.encodings import (
    AtomEncoder,
    DegreeEncoder,
    EdgePathBias,
    GraphToken,
    SpatialBias,
    URPEScale,
    VirtualDistanceBias,
    distance_slots,
)

H = 4


@pytest.fixture(scope="module")
def batch(zinc_graphs, zinc_collate):
    return zinc_collate(zinc_graphs[:6])


def test_distance_slots():
    spd = torch.tensor([[[0, 1, 7], [1, 0, -1], [7, -1, 0]]], dtype=torch.int16)
    slots = distance_slots(spd, max_spd=5)
    assert slots.tolist() == [[[0, 1, 5], [1, 0, 6], [5, 6, 0]]]
    assert slots.dtype == torch.int32


def test_edge_path_bias_is_the_mean_of_hop_transformed_bond_values(batch):
    torch.manual_seed(0)
    enc = EdgePathBias(num_bond_embeddings=5, num_heads=H, max_hops=3)  # the first 3 of K = 5 hops
    out = enc(batch.edge_attr, batch.path_edges[..., :3].contiguous())
    b, n = batch.node_mask.shape
    assert out.shape == (b, H, n, n)

    table = enc.embedding.weight.detach()
    checked_long_paths = 0
    for g in range(b):
        for i in range(int(batch.num_nodes[g])):
            for j in range(int(batch.num_nodes[g])):
                hops = [int(e) for e in batch.path_edges[g, i, j, :3] if e >= 0]
                expected = torch.zeros(H)
                for k, e in enumerate(hops):
                    bond_value = table[batch.edge_attr[e].long()].mean(0)  # mean over columns
                    expected += bond_value @ enc.hop_weight[k].detach()
                expected /= max(len(hops), 1)
                torch.testing.assert_close(out[g, :, i, j].detach(), expected, rtol=1e-5, atol=1e-7)
                checked_long_paths += int(batch.spd[g, i, j]) > 3
    assert checked_long_paths > 0, "the batch should contain paths longer than max_hops"
    # Padded pairs and the diagonal carry no edge information.
    assert out[:, :, range(n), range(n)].abs().max() == 0
    with pytest.raises(ValueError, match="path_edges hold 5 hops but the edge encoding has max_hops=3"):
        enc(batch.edge_attr, batch.path_edges)  # other hops than the model's: refused, not cut


def test_the_edge_encodings_forms_agree_with_gradients(zinc_graphs, monkeypatch):
    """On a CPU the edge encoding gathers only the hops present; at the recipe's 20 hops on 64 real
    ZINC graphs it gives the values and gradients of the static form, both by bond counts (ZINC's
    4 bond ids) and by the fixed-shape gather (larger vocabularies)."""
    from graphormer_urpe.data.batch import collate_pyg_graphs

    k = 20
    big = collate_pyg_graphs(zinc_graphs, k, [28], [4])  # ZINC's atom and bond vocabularies
    hops = big.path_edges.reshape(-1, k)
    present = hops >= 0
    assert 0 < present.float().mean() < 0.5 and int(present.sum(-1).max()) > 5
    # The packed sum and the gather on their own, float64, with the gradient to the table.
    rows = big.edge_attr.shape[0]
    index = torch.where(present, hops, 0) + torch.arange(k, dtype=hops.dtype) * rows
    results = []
    for sum_hops in (lambda t: EdgePathBias.sum_hops_packed(t, hops, present, rows),
                     lambda t: EdgePathBias.sum_hops_gather(t, index, present)):
        table = torch.randn(k * rows, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0),
                            requires_grad=True)
        summed = sum_hops(table)
        summed.backward(torch.ones_like(summed).cumsum(0))
        results.append((summed.detach(), table.grad))
    torch.testing.assert_close(results[0], results[1], rtol=1e-12, atol=1e-12)

    # The module: the CPU form equals both static forms (float32, values and parameter gradients).
    torch.manual_seed(0)
    enc = EdgePathBias(num_bond_embeddings=5, num_heads=8, max_hops=k)
    assert enc.counts_bonds
    grad_out = torch.randn(big.node_mask.shape[0], 8, *big.spd.shape[1:])

    def run():
        enc.zero_grad()
        out = enc(big.edge_attr, big.path_edges)
        out.backward(grad_out)
        return [out.detach(), enc.embedding.weight.grad.clone(), enc.hop_weight.grad.clone()]

    packed = run()
    assert packed[0].abs().max() > 0 and packed[1][0].abs().max() == 0  # padding row: no gradient
    monkeypatch.setattr(EdgePathBias, "sum_hops_packed",
                        staticmethod(lambda *a: pytest.fail("the packed sum is CPU eager only")))
    enc.static_shapes = True
    monkeypatch.setattr(EdgePathBias, "sum_hops_gather",
                        staticmethod(lambda *a: pytest.fail("ZINC's 4 bond ids are counted")))
    counted = run()
    monkeypatch.undo()
    enc.counts_bonds = False
    monkeypatch.setattr(EdgePathBias, "sum_hops_counted",
                        staticmethod(lambda *a: pytest.fail("counts_bonds is off")))
    gathered = run()
    for form in (counted, gathered):
        torch.testing.assert_close(form[0], packed[0], rtol=1e-5, atol=1e-6)
        # The gradients add ~10^5 pair terms in another order (float32).
        torch.testing.assert_close(form[1:], packed[1:], rtol=1e-4, atol=1e-5)


def test_bond_counts_follow_every_column_of_each_hops_edge(zinc_collate, zinc_graphs):
    """OGB-style bonds have several id columns (offset into one table): each (pair, hop) counts
    every column's id of its edge once, absent hops count nothing, and the counted sum is the
    mean over columns of the gather form."""
    batch = zinc_collate(zinc_graphs[:5])
    torch.manual_seed(0)
    edge_attr = torch.stack([batch.edge_attr[:, 0], batch.edge_attr[:, 0] + 4,
                             (batch.edge_attr[:, 0] > 1).int() + 9], dim=1)  # ids 1-4, 5-8, 9-10
    edge_attr[-1] = 0  # the padding row that absent hops (-1) index
    hops = batch.path_edges.reshape(-1, batch.path_edges.shape[-1])
    enc = EdgePathBias(num_bond_embeddings=11, num_heads=4, max_hops=hops.shape[1])
    counts = enc.bond_counts(edge_attr, hops, hops >= 0)
    assert counts.shape == (*hops.shape, 10)
    p, h = (hops >= 0).nonzero()[7].tolist()
    expected = torch.zeros(10)
    expected[edge_attr[hops[p, h]].long() - 1] = 1
    assert torch.equal(counts[p, h], expected)
    assert counts[hops < 0].abs().max() == 0 and counts.sum() == 3 * (hops >= 0).sum()
    enc.static_shapes = True
    counted = enc(edge_attr, batch.path_edges)
    enc.counts_bonds = False
    torch.testing.assert_close(counted, enc(edge_attr, batch.path_edges), rtol=1e-5, atol=1e-7)


def test_spatial_and_virtual_distance_bias(batch):
    torch.manual_seed(0)
    spatial, virtual = SpatialBias(max_spd=4, num_heads=H), VirtualDistanceBias(H)
    slots = distance_slots(batch.spd, 4)
    node_bias = spatial(slots)
    g, i, j = 0, 0, int(batch.num_nodes[0]) - 1
    d = min(int(batch.spd[g, i, j]), 4)
    torch.testing.assert_close(node_bias[g, :, i, j], spatial.embedding.weight[d])

    full = virtual(node_bias)
    n = node_bias.shape[-1]
    assert full.shape == (batch.num_graphs, H, n + 1, n + 1)
    t = virtual.weight.view(1, H, 1)
    torch.testing.assert_close(full[:, :, 0, :], t.expand(batch.num_graphs, H, n + 1))
    torch.testing.assert_close(full[:, :, 1:, 0], t.expand(batch.num_graphs, H, n))
    torch.testing.assert_close(full[:, :, 1:, 1:], node_bias)


def test_node_encodings_zero_at_padding_and_clamp_degrees(batch):
    torch.manual_seed(0)
    atoms, degrees = AtomEncoder(29, 16), DegreeEncoder(max_degree=2, hidden_dim=16)
    h = atoms(batch.x) + degrees(batch.degree, batch.node_mask)
    assert h[~batch.node_mask].abs().max() == 0
    # Degree 3 and 4 atoms share the clamped degree-2 embedding.
    high = batch.node_mask & (batch.degree >= 2)
    expected = degrees.embedding.weight[3].expand(int(high.sum()), -1)
    torch.testing.assert_close(degrees(batch.degree, batch.node_mask)[high], expected)
    assert GraphToken(16)(h).shape == (batch.num_graphs, h.shape[1] + 1, 16)


@pytest.mark.parametrize("columns", [1, 3])
def test_node_encodings_static_shapes_is_the_lookup_with_gradients(batch, columns):
    """The static form's products give the embedding lookups and their gradients on real ZINC
    atoms and degrees (and on three id columns per atom, as OGB's features have), and the
    padding row gets no gradient in either form."""
    torch.manual_seed(0)
    atoms, degrees = AtomEncoder(29, 16), DegreeEncoder(max_degree=62, hidden_dim=16)
    assert atoms.by_product and degrees.by_product
    x = batch.x if columns == 1 else torch.cat([batch.x, (batch.x * 7) % 29, (batch.x * 3) % 29], dim=-1)
    upstream = torch.randn(*batch.node_mask.shape, 16)
    results = []
    for form in (False, True):
        atoms.static_shapes = degrees.static_shapes = form
        h = atoms(x) + degrees(batch.degree, batch.node_mask)
        grads = torch.autograd.grad((h * upstream).sum(), [atoms.embedding.weight, degrees.embedding.weight])
        results.append((h.detach(), grads))
    (h, grads), (h_product, grads_product) = results
    torch.testing.assert_close(h_product, h, rtol=0, atol=1e-7)  # columns summed in another order
    for lookup, product in zip(grads, grads_product):
        torch.testing.assert_close(product, lookup, rtol=1e-5, atol=1e-6)
        assert lookup[0].abs().max() == 0 and product[0].abs().max() == 0
    # Vocabularies beyond 64 rows (OGB's offset atom columns; max_degree 510) keep the lookup.
    assert not AtomEncoder(4609, 16).by_product and not DegreeEncoder(510, 16).by_product


def test_urpe_scale_starts_at_one_with_a_graph_token_slot(batch):
    scale = URPEScale(max_spd=4, num_heads=H)
    assert torch.equal(scale.table(), torch.ones(7, H)) and torch.equal(scale.delta, torch.zeros(7, H))
    slots = URPEScale.slots(distance_slots(batch.spd, 4), 4)
    n = batch.node_mask.shape[1]
    assert slots.shape == (batch.num_graphs, n + 1, n + 1)
    assert (slots[:, 0, :] == 6).all() and (slots[:, :, 0] == 6).all()
    with torch.no_grad():
        scale.delta.copy_(torch.arange(7 * H, dtype=torch.float).view(7, H))
    c = scale(slots)
    g, i, j = 1, 2, 3
    torch.testing.assert_close(c[g, :, i + 1, j + 1], 1 + scale.delta[slots[g, i + 1, j + 1]])


def test_bad_sizes_raise_value_error():
    with pytest.raises(ValueError, match="max_hops"):
        EdgePathBias(5, H, max_hops=0)
    with pytest.raises(ValueError, match="max_spd"):
        URPEScale(max_spd=0, num_heads=H)


def test_lookup_many_equals_each_layers_lookup_with_gradients(batch):
    """The static form's one product for all layers gives each layer's gathered C, and the same
    gradients."""
    torch.manual_seed(0)
    scales = [URPEScale(max_spd=4, num_heads=H) for _ in range(3)]
    for scale in scales:
        torch.nn.init.normal_(scale.delta)
    slots = URPEScale.slots(distance_slots(batch.spd, 4), 4)
    together = URPEScale.lookup_many(scales, slots)
    separate = [scale(slots) for scale in scales]
    for a, b in zip(together, separate):
        assert torch.equal(a, b)  # the product with a one-hot adds zeros: exact
    upstream = [torch.randn_like(t) for t in separate]
    grads_together = torch.autograd.grad(sum((t * u).sum() for t, u in zip(together, upstream)),
                                         [s.delta for s in scales])
    grads_separate = torch.autograd.grad(sum((t * u).sum() for t, u in zip(separate, upstream)),
                                         [s.delta for s in scales])
    for a, b in zip(grads_together, grads_separate):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # pair sums in another order


class OperatorNames(TorchDispatchMode):
    """Each operator's name and the size of its largest tensor argument."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func._overloadpacket.__name__)
        self.sizes.append(max((a.numel() for a in args if isinstance(a, torch.Tensor)), default=0))
        return func(*args, **(kwargs or {}))


def test_lookup_many_backward_copies_nothing(batch):
    """The static form's C for all layers is one batched product whose backward stacks the
    layers' gradients and takes one product: no whole-tensor copy (a GPU step's memory traffic)."""
    scales = [URPEScale(max_spd=4, num_heads=H) for _ in range(3)]
    slots = URPEScale.slots(distance_slots(batch.spd, 4), 4)
    together = URPEScale.lookup_many(scales, slots)
    assert all(c.shape == (slots.shape[0], H, *slots.shape[1:]) for c in together)
    upstream = [torch.randn_like(t) for t in together]
    loss = sum((t * u).sum() for t, u in zip(together, upstream))
    with OperatorNames() as ops:
        loss.backward()
    assert "stack" in ops.names and ("bmm" in ops.names or "mm" in ops.names)
    copies = [(name, size) for name, size in zip(ops.names, ops.sizes)
              if name in ("clone", "copy_", "new_zeros", "as_strided_scatter") and size >= slots.numel()]
    assert copies == []  # (the small tables' gradients are copied into place, as any parameter's)


def test_spatial_bias_static_shapes_is_the_lookup_with_gradients(batch):
    torch.manual_seed(0)
    spatial = SpatialBias(max_spd=4, num_heads=H)
    slots = distance_slots(batch.spd, 4)
    upstream = torch.randn(*slots.shape[:1], H, *slots.shape[1:])
    results = []
    for form in (False, True):
        spatial.static_shapes = form
        out = spatial(slots)
        results.append((out.detach(), torch.autograd.grad((out * upstream).sum(), spatial.embedding.weight)[0]))
    assert torch.equal(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-4, atol=1e-5)  # another order
    # A 512-row table (max_spd 510, the small and base presets) gathers in the static form too.
    wide = SpatialBias(max_spd=510, num_heads=H)
    wide.static_shapes = True
    assert not wide.by_product and not URPEScale(max_spd=510, num_heads=H).by_product
    assert torch.equal(wide(slots), wide.embedding.weight[slots].permute(0, 3, 1, 2))

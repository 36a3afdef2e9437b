"""The sequence encoder: Toeplitz tables, URPE == RPE at C = 1, and what each scheme can see."""
import pytest
import torch

from graphormer_urpe.nn.sequence import (POSITION_SCHEMES, RelativePositionTable,
                                         SequenceTransformer, relative_offsets)

LENGTH, VOCAB = 12, 20


def _model(position, seed=0, **kw):
    torch.manual_seed(seed)
    kw = {"embed_dim": 16, "num_heads": 2, "num_layers": 2, "ffn_dim": 32, **kw}
    return SequenceTransformer(VOCAB, 7, max_len=16, position=position, **kw).eval()


def _randomize_tables(model, generator):
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".table"):
                param.copy_(torch.randn(param.shape, generator=generator))


def test_table_is_toeplitz_in_the_offset():
    table = RelativePositionTable(num_heads=3, max_len=6, init=0.0)
    with torch.no_grad():
        table.table.copy_(torch.randn(table.table.shape))
    matrix = table(5)
    assert matrix.shape == (1, 3, 5, 5)
    for i in range(5):
        for j in range(5):
            # the column of offset j - i, counted from -(max_len - 1)
            assert torch.equal(matrix[0, :, i, j], table.table[:, (j - i) + 5])
    assert table.offsets()[5] == 0 and table.offsets().shape == (11,)


def test_relative_offsets_rejects_too_long_sequences():
    with pytest.raises(ValueError, match="max_len"):
        relative_offsets(9, max_len=8)


def test_urpe_with_unit_scale_equals_rpe_exactly():
    rpe = _model("rpe")
    _randomize_tables(rpe, torch.Generator().manual_seed(1))  # a non-trivial bias B
    urpe = _model("urpe")
    missing, unexpected = urpe.load_state_dict(rpe.state_dict(), strict=False)
    assert not unexpected and missing and all(k.endswith("scale.table") for k in missing)
    assert all(torch.all(layer.scale.table == 1) for layer in urpe.layers)  # C initialised to 1
    tokens = torch.randint(VOCAB, (3, LENGTH), dtype=torch.int32)
    assert torch.equal(urpe(tokens), rpe(tokens))
    # ... and C really enters the attention: moving it changes the output.
    with torch.no_grad():
        urpe.layers[0].scale.table.mul_(torch.linspace(0.5, 1.5, urpe.layers[0].scale.table.shape[1]))
    assert not torch.allclose(urpe(tokens), rpe(tokens))


def test_rpe_cannot_tell_positions_apart_on_a_constant_sequence_but_urpe_can():
    """The paper's counterexample: with identical tokens every softmax row averages identical
    values, so any RPE bias gives the same output everywhere; a URPE scale breaks that."""
    generator = torch.Generator().manual_seed(2)
    tokens = torch.full((1, LENGTH), 3, dtype=torch.int32)
    rpe = _model("rpe")
    _randomize_tables(rpe, generator)
    out = rpe(tokens)[0]
    torch.testing.assert_close(out, out[:1].expand_as(out), atol=1e-5, rtol=1e-5)
    urpe = _model("urpe")
    _randomize_tables(urpe, generator)
    out = urpe(tokens)[0]
    assert (out - out[:1]).abs().amax() > 1e-2


def test_no_positions_means_permutation_equivariant_and_ape_is_not():
    tokens = torch.randint(VOCAB, (2, LENGTH), dtype=torch.int32)
    perm = torch.randperm(LENGTH)
    none = _model("none")
    torch.testing.assert_close(none(tokens[:, perm]), none(tokens)[:, perm], atol=1e-5, rtol=1e-5)
    ape = _model("ape")
    torch.nn.init.normal_(ape.position_embedding.weight)
    assert not torch.allclose(ape(tokens[:, perm]), ape(tokens)[:, perm], atol=1e-3)


@pytest.mark.parametrize("position", POSITION_SCHEMES)
def test_shapes_and_tables_per_scheme(position):
    model = _model(position)
    logits = model(torch.randint(VOCAB, (2, LENGTH)))
    assert logits.shape == (2, LENGTH, 7)
    tables = model.relative_tables()
    expected = {"none": set(), "ape": set(), "rpe": {"bias"}, "urpe": {"bias", "scale"}}[position]
    assert set(tables) == expected
    for table in tables.values():
        assert table.shape == (2, 2, 31)  # [layers, heads, 2 * max_len - 1]


def test_bad_arguments_raise_value_errors():
    with pytest.raises(ValueError, match="position"):
        _model("alibi")
    with pytest.raises(ValueError, match="max_len"):
        _model("urpe")(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[B, L\]"):
        _model("urpe")(torch.zeros(17, dtype=torch.long))

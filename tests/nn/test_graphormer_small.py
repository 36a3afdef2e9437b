"""Graphormer-small (the paper's PCQM4M model): the preset and its parameter count against
Graphormer v1's code and the paper's 12.5M."""
from __future__ import annotations

from test_graphormer import _graphormer_v1_count  # the closed-form count of Graphormer v1's model.py

from graphormer_urpe.data.feature_ids import num_embeddings
from graphormer_urpe.data.featurize import OGB_ATOM_FEATURE_DIMS, OGB_BOND_FEATURE_DIMS
from graphormer_urpe.nn.graphormer import PRESETS, Graphormer, count_parameters

OGB_VOCAB = {"num_atom_embeddings": num_embeddings(OGB_ATOM_FEATURE_DIMS),
             "num_bond_embeddings": num_embeddings(OGB_BOND_FEATURE_DIMS)}


def test_small_preset_is_the_papers_graphormer_small():
    small = PRESETS["small"]
    assert (small.num_layers, small.hidden_dim, small.ffn_dim, small.num_heads) == (6, 512, 512, 32)
    # Graphormer v1's PCQM4M-LSC recipe: dropout 0.1 on the input and both residual branches,
    # attention dropout 0.1, no dropout inside the FFN.
    assert (small.dropout, small.attention_dropout, small.activation_dropout) == (0.1, 0.1, 0.0)
    assert (small.max_degree, small.max_spd) == (510, 510)


def test_small_parameter_count_is_the_papers_12_5m_with_graphormer_v1_tables(capsys):
    # Graphormer v1 on PCQM4M-LSC: atom table 512 x 9 + 1 rows, edge table 512 x 3 + 1,
    # in- and out-degree tables 512, spatial 512, 128 hop matrices; 6 x 512 / 512 / 32 heads.
    v1 = _graphormer_v1_count(512 * 9 + 1, 512 * 3 + 1, 512, 512, 128, 6, 512, 512, 32)
    v1_tables = Graphormer.from_preset("small", num_atom_embeddings=512 * 9 + 1,
                                       num_bond_embeddings=512 * 3 + 1, max_hops=128, attention="rpe")
    # Our one degree table replaces v1's in- + out-degree tables (equal on molecules).
    assert count_parameters(v1_tables) == v1 - 512 * 512 == 12_288_577
    assert abs(count_parameters(v1_tables) / 12.5e6 - 1) < 0.03  # the paper: 12.5M

    # With the tables sized to what OGB features can index (as for every preset), the blocks are
    # identical and only the never-read rows are gone.
    counts = {att: count_parameters(Graphormer.from_preset("small", **OGB_VOCAB, attention=att))
              for att in ("rpe", "urpe")}
    unread = (512 * 9 + 1 - OGB_VOCAB["num_atom_embeddings"]) * 512 \
        + (512 * 3 + 1 - OGB_VOCAB["num_bond_embeddings"]) * 32 + (128 - 5) * 32 * 32
    assert counts["rpe"] == count_parameters(v1_tables) - unread == 9_843_681
    assert counts["urpe"] - counts["rpe"] == 6 * 32 * (510 + 3)
    with capsys.disabled():
        print(f"\nGraphormer-small: v1 code {v1:,d}; ours with v1 tables {count_parameters(v1_tables):,d}; "
              f"OGB vocab rpe {counts['rpe']:,d} / urpe {counts['urpe']:,d}")

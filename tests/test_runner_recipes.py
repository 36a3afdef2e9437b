"""``graphormer-urpe-ablation`` and ``graphormer-urpe-hpopt`` take the packaged recipes by name
from any folder, as ``graphormer-urpe`` does, and refuse an unknown name in one line before any
work."""
from __future__ import annotations

import pytest

from graphormer_urpe.cli import ablation
from graphormer_urpe.cli import hpopt
from graphormer_urpe.training.recipes import RECIPES_DIR, recipe_names


def test_the_ablation_takes_recipes_by_name_and_defaults_to_zinc(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    args, _ = ablation.parse_args([])
    assert args.config == ["zinc"]
    grid = ablation.grid_of(*ablation.parse_args(["--config", "zinc", "--config", "rpe", "--seeds", "0"]))
    assert grid.recipe_args == ["--config", "zinc", "--config", "rpe"]  # names: each fit resolves them
    assert grid.name.startswith("zinc+rpe-")
    with pytest.raises(SystemExit) as refused:
        ablation.parse_args(["--config", "zinc", "--config", "rpee"])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("graphormer-urpe-ablation: error: --config rpee: no such file, "
                                           "nor a recipe of that name")
    assert all(name in err for name in recipe_names())


def test_hpopt_takes_recipes_by_name(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    args, _ = hpopt.parse_args(["--space", "space.yaml", "--config", "csv", "--n-trials", "1"])
    assert args.config == [str(RECIPES_DIR / "csv.yaml")]
    with pytest.raises(SystemExit) as refused:
        hpopt.parse_args(["--space", "space.yaml", "--config", "csvv", "--n-trials", "1"])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("graphormer-urpe-hpopt: error: --config csvv: no such file, nor a recipe of that name")

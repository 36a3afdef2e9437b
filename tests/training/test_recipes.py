"""The recipes packaged with graphormer-urpe: every command takes them by name from any folder,
lists them, prints one, and refuses an unknown name in one line; the checkout's ``configs/`` is
the same files; no recipe reads a path of the checkout."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from graphormer_urpe.cli.fit import main
from graphormer_urpe.training.lightning_cli import build_cli
from graphormer_urpe.training.recipes import RECIPES_DIR, recipe_names, resolve_config

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
RECIPES = sorted(RECIPES_DIR.glob("*.yaml"))


def test_configs_is_the_packaged_recipes_not_a_copy():
    assert (REPO / "configs").is_symlink()
    assert (REPO / "configs").resolve() == RECIPES_DIR.resolve()
    assert len(RECIPES) >= 13 and recipe_names() == [path.stem for path in RECIPES]


@pytest.mark.parametrize("path", RECIPES, ids=lambda path: path.stem)
def test_each_recipe_reads_nothing_of_the_checkout_and_says_what_it_is(path):
    text = path.read_text()
    assert "../" not in text and "configs/" not in text and "shared/" not in text
    summary = text.splitlines()[0]
    assert summary.startswith("# ") and len(summary) <= 100
    data = yaml.safe_load(text).get("data") or {}
    # a recipe without a data module sets keys on top of another one, and says so first
    assert summary.startswith("# Overlay") == ("class_path" not in data)


def test_the_list_has_one_line_per_recipe_and_a_recipe_prints_as_its_file(tmp_path, capsys):
    listed = subprocess.run([BIN / "graphormer-urpe", "recipes"], capture_output=True, text=True,
                            cwd=tmp_path, timeout=300)
    assert listed.returncode == 0 and listed.stderr == ""
    lines = listed.stdout.splitlines()
    for path in RECIPES:
        [line] = [line for line in lines if line.split()[:1] == [path.stem]]
        assert line.endswith(path.read_text().splitlines()[0][2:])
    assert main(["recipes", "csv"]) == 0 and capsys.readouterr().out == (RECIPES_DIR / "csv.yaml").read_text()
    assert main(["recipes", "zync"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith("graphormer-urpe recipes: error: zync: not a recipe") and "zinc_v2" in err


@pytest.mark.parametrize("args, refused", [
    (["fit", "--config", "zync"], "--config zync"),
    (["fit", "--config", "zinc", "--config=rpee"], "--config rpee"),
    (["fit", "-c", "configs/zinc.yaml"], "-c configs/zinc.yaml"),  # the checkout's path, elsewhere
])
def test_an_unknown_name_is_refused_in_one_line_listing_the_recipes(args, refused, tmp_path, monkeypatch,
                                                                    capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stopped:
        main(args)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"graphormer-urpe: error: {refused}: no such file, nor a recipe of that name")
    assert all(name in err for name in recipe_names())


def test_names_and_files_give_the_same_run_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    by_file = build_cli(["--config", str(REPO / "configs" / "zinc.yaml"),
                         "--config", str(REPO / "configs" / "rpe.yaml")], run=False)
    for spelled in (["--config", "zinc", "--config", "rpe"], ["-c", "zinc.yaml", "--config=rpe"]):
        by_name = build_cli(spelled, run=False)
        assert by_name.model.hparams == by_file.model.hparams
        assert by_name.trainer.default_root_dir == by_file.trainer.default_root_dir


def test_a_file_wins_over_a_recipe_of_its_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_config("rpe") == str(RECIPES_DIR / "rpe.yaml")
    (tmp_path / "rpe").write_text("model:\n  lr: 0.5\n")
    assert resolve_config("rpe") == "rpe"
    inline = '{"model": {"lr": 0.5}}'  # a config given as text goes to LightningCLI as it is
    assert resolve_config(inline) == inline


def test_print_config_shows_a_recipe_in_full_from_any_folder(tmp_path):
    shown = subprocess.run([BIN / "graphormer-urpe", "fit", "--config", "csv", "--print_config"],
                           capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert shown.returncode == 0, shown.stderr[-2000:]
    config = yaml.safe_load(shown.stdout)
    recipe = yaml.safe_load((RECIPES_DIR / "csv.yaml").read_text())
    assert config["data"]["init_args"]["path"] == recipe["data"]["init_args"]["path"] == "data:moleculenet/esol.csv"
    assert config["model"]["init_from"] == "pretrained:zinc-descriptors"
    assert "gradient_clip_algorithm" in config["trainer"]  # every key, not only the recipe's


def test_a_bare_name_of_a_file_here_and_of_a_recipe_says_which_it_read(tmp_path, monkeypatch, caplog):
    """``--config esol`` beside an edited ``./esol.yaml`` reads the recipe and says, in one line,
    that the file here is not read; ``./esol.yaml`` reads the file; ``esol.yaml`` (a file here
    by that exact name) reads the file and says the recipe is not read."""
    monkeypatch.chdir(tmp_path)
    recipe = yaml.safe_load((RECIPES_DIR / "esol.yaml").read_text())
    edited = {**recipe, "trainer": {**recipe["trainer"], "max_epochs": 123}}
    (tmp_path / "esol.yaml").write_text(yaml.safe_dump(edited))
    shown = subprocess.run([BIN / "graphormer-urpe", "fit", "--config", "esol", "--print_config"],
                           capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert yaml.safe_load(shown.stdout)["trainer"]["max_epochs"] == recipe["trainer"]["max_epochs"] != 123
    assert [line for line in shown.stderr.splitlines() if "esol" in line] == [
        f"--config esol: read the packaged recipe {RECIPES_DIR / 'esol.yaml'}, not the file "
        f"{tmp_path / 'esol.yaml'} here (give --config ./esol.yaml to read that file)"]
    caplog.clear()
    assert build_cli(["--config", "./esol.yaml"], run=False).trainer.max_epochs == 123
    assert "--config" not in caplog.text  # a path is the file: nothing to say
    assert build_cli(["--config", "esol.yaml"], run=False).trainer.max_epochs == 123
    assert [m for m in caplog.messages if m.startswith("--config")] == [f"--config esol.yaml: read the file {tmp_path / 'esol.yaml'} here, not the "
                               f"packaged recipe {RECIPES_DIR / 'esol.yaml'} (give that path to read the recipe)"]


@pytest.mark.parametrize("content, reason", [
    ("smiles,y\nCCO,1.5\nCCN,0.5\n", "it reads as plain text"),  # a data file named like the recipe
    ("", "it is empty"),
    ("trainer: [max_steps\n", "while parsing a flow sequence"),  # an edit that broke the YAML
])
def test_a_file_that_is_no_config_is_refused_in_one_line(tmp_path, monkeypatch, capsys, content, reason):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "esol").write_text(content)
    with pytest.raises(SystemExit) as stopped:
        main(["fit", "--config", "esol"])
    out, err = capsys.readouterr()
    assert stopped.value.code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("graphormer-urpe: error: --config esol: not a config file (a YAML mapping of "
                          f"options): {reason}")
    assert err.rstrip().endswith(f"; the packaged recipe of that name is {RECIPES_DIR / 'esol.yaml'}")


@pytest.mark.parametrize("configs", [["--config", "rpe", "--config", "zinc"],
                                     ["--config=quickstart", "-c", str(REPO / "configs" / "zinc.yaml")],
                                     ["--config", "overrides.yaml", "--config", "esol"]])
def test_a_base_recipe_after_an_overlay_is_refused_in_one_line(configs, tmp_path, monkeypatch, capsys):
    """The base would override the overlay's keys (``rpe`` then ``zinc`` trained URPE)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "overrides.yaml").write_text("trainer:\n  max_steps: 10\n")
    with pytest.raises(SystemExit) as stopped:
        main(["fit", *configs])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.count("\n") == 1, err
    overlay = " ".join(configs[:2]) if configs[0] == "--config" else configs[0].replace("=", " ")
    base = " ".join(configs[-2:])
    assert err == (f"graphormer-urpe: error: {base} configures the data, a base recipe, but comes after "
                   f"{overlay}, which sets keys on top of one: the base would override them; give the "
                   f"base first ({base} {overlay})\n")

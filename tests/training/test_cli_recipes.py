"""The training CLI as a user drives it, on CSVs cut from the real ESOL and on ZINC: every task
trains and checkpoints by its own metric, bad targets are refused, overlays compose, the
schedule follows the trainer, ``predict`` writes its predictions."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from graphormer_urpe.prediction.load import load_module
from graphormer_urpe.cli.fit import main
from graphormer_urpe.training.lightning_cli import build_cli

REPO = Path(__file__).resolve().parents[2]
ESOL_TARGET = "measured log solubility in mols per litre"
TINY = {"num_layers": 1, "hidden_dim": 16, "ffn_dim": 16, "num_heads": 2}


@pytest.fixture(scope="module")
def esol_table(esol_csv) -> pd.DataFrame:
    table = pd.read_csv(esol_csv)
    return table[["smiles", ESOL_TARGET]].head(120).reset_index(drop=True)


def csv_args(path: Path, run_dir: Path, *extra: str, targets: list[str] | None = None) -> list[str]:
    return [
        "--config", str(REPO / "configs" / "esol.yaml"),
        "--trainer.default_root_dir", str(run_dir),
        "--trainer.max_steps", "2",
        "--trainer.limit_train_batches", "2",
        "--trainer.limit_val_batches", "1",
        "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false",
        "--model.backbone", json.dumps(TINY),
        "--model.warmup_steps", "1",
        "--data.init_args.path", str(path),
        "--data.init_args.target_columns", json.dumps(targets or ["y"]),
        "--data.init_args.cache_root", str(run_dir.parent / "cache"),
        "--data.init_args.batch_size", "16",
        *extra,
    ]


def _write(table: pd.DataFrame, path: Path) -> Path:
    table.to_csv(path, index=False)
    return path


@pytest.mark.parametrize("task, columns, metric", [
    ("classification", 1, "auroc"),   # binary: one 0/1 column
    ("classification", 2, "auroc"),   # multi-label
    ("multiclass", 1, "accuracy"),    # three classes in one column
])
def test_every_task_trains_and_checkpoints_by_its_metric(esol_table, tmp_path, task, columns,
                                                         metric):
    solubility = esol_table[ESOL_TARGET]
    table = pd.DataFrame({"smiles": esol_table["smiles"]})
    if task == "multiclass":
        table["y"] = np.digitize(solubility, [-4.0, -2.0])  # 0, 1, 2
    else:
        table["y"] = (solubility > -3).astype(int)
        if columns == 2:
            table["y2"] = (solubility > -2).astype(int)
    targets = ["y", "y2"][:columns]
    run_dir = tmp_path / "run"
    cli = build_cli(["fit", *csv_args(_write(table, tmp_path / "t.csv"), run_dir,
                                      "--data.init_args.task", task, targets=targets)])
    assert cli.trainer.global_step == 2
    assert cli.model.model.head.out_features == (3 if task == "multiclass" else columns)
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    best = [n for n in names if n != "last.ckpt"]
    assert len(best) == 1 and best[0].startswith("epoch=0-step=") and f"-val_{metric}=" in best[0]
    score = float(best[0].split("=")[-1].removesuffix(".ckpt"))
    assert 0.0 <= score <= 1.0
    callback = cli.trainer.checkpoint_callback
    assert (callback.monitor, callback.mode) == (f"val/{metric}", "max")


def test_nonfinite_targets_are_rejected_with_one_warning(esol_table, tmp_path, recwarn):
    table = esol_table.rename(columns={ESOL_TARGET: "y"}).astype({"y": object})
    for row, value in ((3, "inf"), (7, "-inf"), (11, "1e39")):  # 1e39 overflows float32
        table.loc[row, "y"] = value
    run_dir = tmp_path / "run"
    cli = build_cli(["fit", *csv_args(_write(table, tmp_path / "t.csv"), run_dir)])
    messages = [str(w.message) for w in recwarn if "skipped" in str(w.message)]
    assert messages == [f"{tmp_path / 't.csv'}: skipped 3 of 120 rows with an infinite or "
                        "out-of-range target (lines 5, 9, 13)"]
    graphs, graph_of_row, y, splits = cli.datamodule.store()
    used = np.concatenate(list(splits.values()))
    assert len(used) == 117 and not set(used.tolist()) & {3, 7, 11}
    assert np.isfinite(y[used]).all()
    assert all(math.isfinite(float(p.name.split("=")[-1].removesuffix(".ckpt")))
               for p in (run_dir / "checkpoints").iterdir() if p.name != "last.ckpt")


def test_target_column_without_a_usable_value_is_an_error(esol_table, tmp_path):
    table = esol_table.rename(columns={ESOL_TARGET: "y"})
    table["empty"] = np.nan
    path = _write(table, tmp_path / "t.csv")
    with pytest.raises(ValueError, match=r"t.csv: target column\(s\) \['empty'\] have no usable"):
        build_cli(["fit", *csv_args(path, tmp_path / "run", targets=["y", "empty"])])


def test_nonfinite_training_loss_stops_the_run_without_a_checkpoint(esol_table, tmp_path, capsys):
    table = esol_table.rename(columns={ESOL_TARGET: "y"})
    table["y"] = 3e38  # finite in float32, but the batch's summed L1 loss overflows
    run_dir = tmp_path / "run"
    code = main(["fit", *csv_args(_write(table, tmp_path / "t.csv"), run_dir)])
    assert code == 1
    assert "had a non-finite loss or gradient" in capsys.readouterr().err
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())


def test_rejected_smiles_warning_is_printed_once(esol_table, tmp_path, recwarn):
    table = esol_table.rename(columns={ESOL_TARGET: "y"})
    table.loc[5, "smiles"] = "not a molecule"
    build_cli(["fit", *csv_args(_write(table, tmp_path / "t.csv"), tmp_path / "run")])
    messages = [str(w.message) for w in recwarn if "skipped" in str(w.message)]
    assert len(messages) == 1 and "skipped 1 of 120 rows whose SMILES RDKit rejects (lines 7)" \
        in messages[0]


def test_predict_writes_predictions_in_input_order(esol_table, tmp_path):
    table = esol_table.rename(columns={ESOL_TARGET: "y"})
    path = _write(table, tmp_path / "t.csv")
    run_dir = tmp_path / "run"
    build_cli(["fit", *csv_args(path, run_dir)])
    ckpt = str(run_dir / "checkpoints" / "last.ckpt")
    cli = build_cli(["predict", *csv_args(path, run_dir, "--ckpt_path", ckpt)])
    written = pd.read_csv(run_dir / "predictions.csv", keep_default_na=False)
    test_rows = cli.datamodule.store()[3]["test"]
    assert list(written.columns) == ["row", "smiles", "prediction_y", "error"]
    assert written["smiles"].tolist() == [table["smiles"][r].strip() for r in test_rows]
    # The same numbers as graphormer-urpe-predict computes from the checkpoint alone.
    from graphormer_urpe.prediction.model import predict_smiles
    from graphormer_urpe.prediction.table import InputRow
    expected = predict_smiles(load_module(ckpt), [InputRow(s) for s in written["smiles"]])
    np.testing.assert_allclose(written["prediction_y"].to_numpy(), expected[:, 0], rtol=1e-4,
                               atol=1e-5)
    chosen = tmp_path / "elsewhere" / "out.csv"
    build_cli(["predict", *csv_args(path, run_dir, "--ckpt_path", ckpt,
                                     "--prediction_writer.output", str(chosen))])
    assert pd.read_csv(chosen).shape == written.shape


# --- configs ---------------------------------------------------------------------------------
def _parsed(*args: str):
    cli = build_cli(["--config", str(REPO / "configs" / "zinc.yaml"), *args], run=False)
    return cli.model.hparams


@pytest.mark.parametrize("order", ["overlay_first", "override_first"])
def test_backbone_overrides_merge_in_any_order(order):
    rpe = ["--config", str(REPO / "configs" / "rpe.yaml")]
    smaller = ["--model.backbone", '{"num_layers": 4}']
    hparams = _parsed(*(rpe + smaller if order == "overlay_first" else smaller + rpe))
    assert hparams.backbone["attention"] == "rpe" and hparams.backbone["num_layers"] == 4
    assert hparams.backbone["hidden_dim"] == 80  # the rest is still the slim preset


def test_compiled_overlay_keeps_the_recipes_attention():
    hparams = _parsed("--config", str(REPO / "configs" / "rpe.yaml"),
                      "--config", str(REPO / "configs" / "compiled.yaml"),
                      "--model.compile", "false", "--data.init_args.device_resident", "false",
                      "--model.backbone.attention_impl", "eager")
    assert hparams.backbone["attention"] == "rpe"
    assert "attention" not in yaml.safe_load((REPO / "configs" / "compiled.yaml").read_text())["model"]["backbone"]


def test_preset_with_partial_override_and_small_preset():
    hparams = _parsed("--model.preset", "small", "--model.backbone.num_layers", "2")
    assert (hparams.backbone["num_layers"], hparams.backbone["hidden_dim"],
            hparams.backbone["num_heads"]) == (2, 512, 32)


def test_unknown_backbone_key_fails_at_parse_time_naming_valid_keys(capsys):
    with pytest.raises(SystemExit):
        build_cli(["--config", str(REPO / "configs" / "zinc.yaml"),
                   "--model.backbone", '{"num_layer": 4}'], run=False)
    err = capsys.readouterr().err
    assert "num_layer" in err and "--model.backbone.num_layers" in err


def test_help_lists_the_backbone_keys(capsys):
    assert main(["fit", "--help"]) == 0
    out = capsys.readouterr().out
    for key in ("num_layers", "hidden_dim", "attention", "max_spd", "attention_impl"):
        assert f"--model.backbone.{key}" in out


def test_each_config_names_its_own_run_directory():
    run_dirs = {}
    for path in sorted((REPO / "configs").glob("*.yaml")):
        run_dir = (yaml.safe_load(path.read_text()).get("trainer") or {}).get("default_root_dir")
        if run_dir is not None:
            run_dirs.setdefault(run_dir, []).append(path.name)
    assert all(len(names) == 1 for names in run_dirs.values()), run_dirs
    quick = build_cli(["--config", str(REPO / "configs" / "zinc.yaml"),
                       "--config", str(REPO / "configs" / "quickstart.yaml")], run=False)
    assert quick.trainer.default_root_dir.rstrip("/").endswith("runs/zinc_quickstart")


def test_console_script_logs_builds_once_without_lightning_tips(esol_table, tmp_path):
    import subprocess
    import sys

    table = esol_table.rename(columns={ESOL_TARGET: "y"})
    table.loc[5, "smiles"] = "not a molecule"
    path = _write(table, tmp_path / "t.csv")
    script = Path(sys.executable).with_name("graphormer-urpe")
    result = subprocess.run([str(script), "fit", *csv_args(path, tmp_path / "run")],
                            capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "encoding 119 graphs (max_hops=5)" in output
    assert output.count("skipped 1 of 120 rows whose SMILES RDKit rejects (lines 7)") == 1
    assert "Tip:" not in output


@pytest.mark.parametrize("overlay, expected", [
    # Graphormer v1's examples/benchmarking-gnns (ZINC-12k, the URPE paper's baseline)
    (None, {"batch": 256, "hops": 20, "warmup": 40000, "clip": None, "val_every": 10,
            "dropouts": (0.1, 0.1, 0.0)}),
    # Graphormer v2's examples/property_prediction/zinc.sh
    ("zinc_v2.yaml", {"batch": 64, "hops": 5, "warmup": 60000, "clip": 5.0, "val_every": 1,
                      "dropouts": (0.0, 0.1, 0.1)}),
])
def test_zinc_recipes_resolve_to_graphormers_values(overlay, expected):
    args = ["--config", str(REPO / "configs" / "zinc.yaml")]
    if overlay:
        args += ["--config", str(REPO / "configs" / overlay)]
    cli = build_cli(args, run=False)
    hp, trainer, backbone = cli.model.hparams, cli.trainer, cli.model.hparams.backbone
    got = {"batch": cli.datamodule.batch_size, "hops": cli.model.facts.max_hops, "warmup": hp.warmup_steps,
           "clip": trainer.gradient_clip_val, "val_every": trainer.check_val_every_n_epoch,
           "dropouts": (backbone["dropout"], backbone["attention_dropout"],
                        backbone["activation_dropout"])}
    assert got == expected
    assert (trainer.max_steps, hp.lr, hp.end_lr, hp.power, hp.weight_decay, tuple(hp.betas), hp.eps) \
        == (400_000, 2e-4, 1e-9, 1.0, 0.01, (0.9, 0.999), 1e-8)
    assert str(trainer.precision) == "bf16-mixed" and backbone["attention"] == "urpe"
    assert (backbone["num_layers"], backbone["hidden_dim"], backbone["num_heads"]) == (12, 80, 8)

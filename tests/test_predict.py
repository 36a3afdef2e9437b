"""graphormer-urpe-predict: a checkpoint trained through the CLI on the real ESOL CSV predicts
SMILES exactly as the data pipeline does, keeps input order, and reports bad rows and files."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from graphormer_urpe.predict import main as predict_main
from graphormer_urpe.training.cli import build_cli

REPO = Path(__file__).resolve().parents[1]
TINY_BACKBONE = {"num_layers": 2, "hidden_dim": 16, "ffn_dim": 16, "num_heads": 2}


@pytest.fixture(scope="module")
def esol_run(shared_data_dir, tmp_path_factory):
    """A tiny URPE model fitted for 3 steps on ESOL by the CLI, and its DataModule."""
    work = tmp_path_factory.mktemp("esol")
    cli = build_cli([
        "fit", "--config", str(REPO / "configs" / "esol.yaml"),
        "--trainer.default_root_dir", str(work / "run"),
        "--trainer.max_steps", "3", "--trainer.limit_val_batches", "1",
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        "--model.backbone", json.dumps(TINY_BACKBONE), "--model.warmup_steps", "1",
        "--data.init_args.path", str(shared_data_dir / "moleculenet" / "esol.csv"),
        "--data.init_args.cache_root", str(work / "cache"),
    ])
    return cli, work / "run" / "checkpoints" / "last.ckpt"


def read_output(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_predictions_match_the_data_pipeline_and_keep_input_order(esol_run, tmp_path):
    cli, ckpt = esol_run
    data = cli.datamodule
    test_rows = data.store()[3]["test"]
    smiles = [s for s in read_csv_column(data.path, "smiles")]
    expected = torch.cat([out["prediction"] for out in cli.trainer.predict(
        cli.model, datamodule=data, ckpt_path=str(ckpt))]).squeeze(1).numpy()

    inputs = [smiles[r] for r in test_rows]
    mixed = ["C1CC", inputs[0], "", "not a molecule", *inputs[1:]]
    source = tmp_path / "in.csv"
    with open(source, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["name", "SMILES"])
        writer.writerows([[f"m{i}", s] for i, s in enumerate(mixed)])
    assert predict_main(["--ckpt", str(ckpt), "--input", str(source),
                         "--output", str(tmp_path / "out.csv")]) == 0

    rows = read_output(tmp_path / "out.csv")
    assert [r["smiles"] for r in rows] == mixed
    assert [int(r["row"]) for r in rows] == list(range(1, len(mixed) + 1))
    for bad in (0, 2, 3):
        assert rows[bad]["prediction"] == "" and rows[bad]["error"]
    assert "cannot parse" in rows[0]["error"] and rows[2]["error"] == "empty SMILES"
    got = np.array([float(r["prediction"]) for i, r in enumerate(rows) if i not in (0, 2, 3)])
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def read_csv_column(path: Path, column: str) -> list[str]:
    with open(path, newline="") as handle:
        return [row[column] for row in csv.DictReader(handle)]


def test_plain_smiles_file_and_too_large_molecules(esol_run, tmp_path):
    _, ckpt = esol_run
    source = tmp_path / "in.smi"
    source.write_text("CCO\nCCCCCCCCCCCCCCCCCCCC\nc1ccccc1\n")
    assert predict_main(["--ckpt", str(ckpt), "--input", str(source), "--output",
                         str(tmp_path / "out.csv"), "--max-nodes", "10"]) == 0
    rows = read_output(tmp_path / "out.csv")
    assert [r["smiles"] for r in rows] == ["CCO", "CCCCCCCCCCCCCCCCCCCC", "c1ccccc1"]
    assert rows[0]["prediction"] and rows[2]["prediction"]
    assert rows[1]["prediction"] == "" and "20 atoms, more than max_nodes=10" in rows[1]["error"]


@pytest.mark.parametrize("problem", ["missing", "corrupt", "truncated", "incompatible", "foreign"])
def test_bad_checkpoints_get_a_clear_error(esol_run, tmp_path, capsys, problem):
    _, ckpt = esol_run
    bad = tmp_path / "bad.ckpt"
    if problem == "corrupt":
        bad.write_bytes(b"definitely not a checkpoint")
    elif problem == "truncated":
        bad.write_bytes(ckpt.read_bytes()[:4096])
    elif problem == "incompatible":  # weights of another architecture under these hyperparameters
        checkpoint = torch.load(ckpt, weights_only=False)
        checkpoint["hyper_parameters"]["backbone"] = {**TINY_BACKBONE, "hidden_dim": 32}
        torch.save(checkpoint, bad)
    elif problem == "foreign":
        torch.save({"weights": torch.zeros(3)}, bad)
    source = tmp_path / "in.smi"
    source.write_text("CCO\n")
    code = predict_main(["--ckpt", str(bad), "--input", str(source), "--output", str(tmp_path / "o.csv")])
    assert code == 2
    message = capsys.readouterr().err
    assert str(bad) in message
    assert {"missing": "does not exist", "corrupt": "cannot be read", "truncated": "cannot be read",
            "incompatible": "does not match", "foreign": "not a Lightning checkpoint"}[problem] in message
    assert not (tmp_path / "o.csv").exists()


def test_csv_without_smiles_column_is_an_error(esol_run, tmp_path, capsys):
    _, ckpt = esol_run
    source = tmp_path / "in.csv"
    source.write_text("name,formula\nethanol,C2H6O\n")
    assert predict_main(["--ckpt", str(ckpt), "--input", str(source), "--output",
                         str(tmp_path / "o.csv")]) == 2
    assert "no 'smiles' column" in capsys.readouterr().err

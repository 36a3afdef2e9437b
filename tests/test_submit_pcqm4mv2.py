"""scripts/submit_pcqm4mv2.py end to end: a tiny model fitted by the CLI on an OGB-format fixture
of real PCQM4Mv2 molecules with the official test split sizes writes a valid submission."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from graphormer_urpe.data.pcqm4mv2 import write_pcqm4mv2_root
from graphormer_urpe.training.cli import build_cli
from graphormer_urpe.training.module import GraphormerModule

REPO = Path(__file__).resolve().parents[1]
SPLIT_SIZES = {"train": 1200, "valid": 400, "test-dev": 147_037, "test-challenge": 147_432}


@pytest.fixture(scope="module")
def fitted(shared_data_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("pcqm")
    folder = write_pcqm4mv2_root(work / "root", shared_data_dir / "pcqm4mv2" / "pcqm4mv2_first2k_3d.csv.gz",
                                 split_sizes=SPLIT_SIZES)
    build_cli([
        "fit", "--config", str(REPO / "configs" / "pcqm4mv2.yaml"),
        "--trainer.default_root_dir", str(work / "run"),
        "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
        "--trainer.limit_val_batches", "1", "--trainer.precision", "32-true",
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        "--model.backbone", json.dumps({"num_layers": 1, "hidden_dim": 16, "ffn_dim": 16, "num_heads": 2}),
        "--data.init_args.root", str(work / "root"), "--data.init_args.batch_size", "32",
    ])
    return work, folder, work / "run" / "checkpoints" / "last.ckpt"


def test_submission_files_valid_mae_and_row_order(fitted):
    work, folder, ckpt = fitted
    out_dir = work / "submission"
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "submit_pcqm4mv2.py"), "--ckpt", str(ckpt),
                             "--root", str(work / "root"), "--out-dir", str(out_dir), "--batch-size", "4096"],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["test-dev_count"] == 147_037 and summary["test-challenge_count"] == 147_432

    table = pd.read_csv(folder / "raw" / "data.csv.gz")
    offset = SPLIT_SIZES["train"] + SPLIT_SIZES["valid"]
    for split, size in (("test-dev", 147_037), ("test-challenge", 147_432)):
        pred = np.load(out_dir / f"y_pred_pcqm4m-v2_{split}.npz")["y_pred"]
        assert pred.shape == (size,) and np.isfinite(pred).all()
        # rows holding the same molecule get the same prediction: predictions are in split order
        smiles = table["smiles"].to_numpy()[offset:offset + size]
        first = pd.Series(pred).groupby(smiles).transform("first").to_numpy()
        np.testing.assert_allclose(pred, first, rtol=1e-5, atol=1e-6)
        assert len(np.unique(np.round(pred, 5))) > 100  # and different molecules differ
        offset += size
    # the valid MAE is OGB's evaluator on the real gaps of the valid rows
    assert 0.0 < summary["valid_mae"] < 20.0 and summary["valid_count"] == SPLIT_SIZES["valid"]


@pytest.mark.parametrize("problem", ["missing", "zinc model"])
def test_refuses_missing_or_foreign_checkpoints(fitted, tmp_path, problem):
    work, _, _ = fitted
    ckpt = tmp_path / "model.ckpt"
    if problem == "zinc model":
        zinc = GraphormerModule(num_atom_embeddings=29, num_bond_embeddings=5, featurizer="zinc",
                                backbone={"num_layers": 1, "hidden_dim": 16, "ffn_dim": 16, "num_heads": 2})
        torch.save({"state_dict": zinc.state_dict(), "hyper_parameters": dict(zinc.hparams)}, ckpt)
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "submit_pcqm4mv2.py"), "--ckpt", str(ckpt),
                             "--root", str(work / "root"), "--out-dir", str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert {"missing": "does not exist", "zinc model": "featurizer 'zinc'"}[problem] in result.stderr
    assert not (tmp_path / "out").exists()

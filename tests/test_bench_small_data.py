"""scripts/bench_small_data.py on real ESOL: every arm reads the one split file written per
(split, seed), which holds exactly the rows CSVDataModule draws; each arm predicts the test
molecules through its installed command and is scored on them; a finished run is not repeated."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from graphormer_urpe.data import CSVDataModule
from graphormer_urpe.data.descriptors import descriptor_names

REPO = Path(__file__).resolve().parents[1]
TARGET = "measured log solubility in mols per litre"
TINY = {"num_layers": 2, "hidden_dim": 16, "ffn_dim": 16, "num_heads": 2}


def bench(work: Path, esol: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "scripts/bench_small_data.py", "--csv", str(esol), "--seeds", "3",
               "--splits", "scaffold", "--jobs", "1", "--work", str(work), *extra,
               f"--graphormer-args=--trainer.max_steps 2 --trainer.val_check_interval 2 --model.backbone '{json.dumps(TINY)}' "
               "--trainer.enable_model_summary false"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


def test_scratch_arm_on_the_shared_split_file(esol_csv, tmp_path):
    work = tmp_path / "bench"
    done = bench(work, esol_csv, "--arms", "scratch")
    split_file = work / "splits" / "scaffold-seed3.json"
    rows = json.loads(split_file.read_text())[0]
    expected = CSVDataModule(path=str(esol_csv), target_columns=[TARGET], split="scaffold", seed=3,
                             cache_root=str(tmp_path / "cache"), build_workers=1, encode_threads=1).store()[3]
    for name in ("train", "val", "test"):
        np.testing.assert_array_equal(rows[name], expected[name])
    test_csv = pd.read_csv(split_file.with_suffix(".test.csv"))
    assert len(test_csv) == len(rows["test"]) > 100
    assert list(test_csv["smiles"]) == list(pd.read_csv(esol_csv)["smiles"].iloc[rows["test"]])

    summary = json.loads(done.stdout.strip().splitlines()[-1])
    (row,) = summary["rows"]
    assert (row["split"], row["arm"]) == ("scaffold", "scratch")
    predictions = pd.read_csv(work / "scaffold" / "scratch" / "seed3" / "test_predictions.csv")
    error = predictions[f"prediction_{TARGET}"].to_numpy() - test_csv[TARGET].to_numpy()
    assert row["test_rmse"] == [float(np.sqrt(np.mean(error ** 2)))]
    assert "| scaffold | scratch |" in done.stdout

    again = bench(work, esol_csv, "--arms", "scratch")  # the finished run is read, not repeated
    assert "seed 3: test RMSE" not in again.stdout
    assert json.loads(again.stdout.strip().splitlines()[-1]) == summary


def test_frozen_arm_is_the_embedder_with_a_head_chosen_on_validation(esol_csv, tmp_path):
    """The fast mode's arm on 300 ESOL molecules: GraphormerEmbedder's vectors of every row, a head
    of the grid chosen on the split's validation rows, scored on its test rows."""
    small = tmp_path / "esol300.csv"
    pd.read_csv(esol_csv).head(300).to_csv(small, index=False)
    work = tmp_path / "bench"
    done = bench(work, small, "--arms", "frozen")
    run = work / "scaffold" / "frozen" / "seed3"
    features = np.load(run / "embeddings.npy")
    assert features.shape == (300, 192 + len(descriptor_names())) and np.isfinite(features).all()
    head = json.loads((run / "head.json").read_text())
    assert head["chosen"] == min(head["val_rmse"], key=head["val_rmse"].get)
    (row,) = json.loads(done.stdout.strip().splitlines()[-1])["rows"]
    test = pd.read_csv(work / "splits" / "scaffold-seed3.test.csv")
    assert row["arm"] == "frozen" and row["test_rmse"][0] < test[TARGET].std()


def test_members_are_fits_of_other_seeds_predicting_their_mean(esol_csv, tmp_path):
    """``--members 2``: two fits on the split file, seeded apart; the run predicts their mean, and
    its validation RMSE is that mean's on the split's validation rows."""
    work = tmp_path / "bench"
    done = bench(work, esol_csv, "--arms", "scratch", "--members", "2", "--validation-only")
    run = work / "scaffold" / "scratch" / "seed3"
    logged = (run / "run.log").read_text()
    assert "--seed_everything 3 " in logged and "--seed_everything 1003 " in logged
    split_file = work / "splits" / "scaffold-seed3.json"
    val = pd.read_csv(split_file.with_suffix(".val.csv"))
    assert list(val["smiles"]) == list(pd.read_csv(esol_csv)["smiles"].iloc[json.loads(split_file.read_text())[0]["val"]])
    alone = []
    for k in (0, 1):
        out = tmp_path / f"member{k}.csv"
        subprocess.run([str(Path(sys.executable).with_name("graphormer-urpe-predict")), "--ckpt", str(run / f"member{k}"),
                        "--input", str(split_file.with_suffix(".val.csv")), "--output", str(out), "--workers", "0",
                        "--quiet"], cwd=REPO, check=True, capture_output=True)
        alone.append(pd.read_csv(out)[f"prediction_{TARGET}"].to_numpy())
    assert not np.allclose(alone[0], alone[1])  # other seeds, other models
    mean = pd.read_csv(run / "val_predictions.csv")[f"prediction_{TARGET}"].to_numpy()
    np.testing.assert_allclose(mean, (alone[0] + alone[1]) / 2, rtol=1e-5, atol=1e-5)
    (row,) = json.loads(done.stdout.strip().splitlines()[-1])["rows"]
    expected = float(np.sqrt(np.mean((mean - val[TARGET].to_numpy()) ** 2)))
    assert row["val_rmse"] == [expected]


def test_blend_is_the_mean_of_the_fine_tuned_and_fast_mode_predictions(esol_csv, tmp_path):
    """``--arms blend`` on 300 ESOL molecules runs its two parts (the shipped backbone fine-tuned
    for 2 steps, the fast mode) and predicts their row-by-row mean, on the test rows and on the
    validation rows that choose between the arms; its wall time is theirs together."""
    small = tmp_path / "esol300.csv"
    pd.read_csv(esol_csv).head(300).to_csv(small, index=False)
    work = tmp_path / "bench"
    command = [sys.executable, "scripts/bench_small_data.py", "--csv", str(small), "--seeds", "3",
               "--splits", "scaffold", "--jobs", "1", "--work", str(work), "--arms", "blend",
               "--graphormer-args=--trainer.max_steps 2 --trainer.val_check_interval 2 "
               "--trainer.enable_model_summary false"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    split_file = work / "splits" / "scaffold-seed3.json"
    runs = {arm: work / "scaffold" / arm / "seed3" for arm in ("finetuned", "frozen", "blend")}
    for name, rows_csv in (("test", split_file.with_suffix(".test.csv")), ("val", split_file.with_suffix(".val.csv"))):
        truth = pd.read_csv(rows_csv)[TARGET].to_numpy()
        fine_tuned = pd.read_csv(runs["finetuned"] / f"{name}_predictions.csv")[f"prediction_{TARGET}"].to_numpy()
        fast = pd.read_csv(runs["frozen"] / f"{name}_predictions.csv")["prediction"].to_numpy()
        blended = pd.read_csv(runs["blend"] / f"{name}_predictions.csv")["prediction"].to_numpy()
        assert len(blended) == len(truth) and not np.allclose(fine_tuned, fast)
        np.testing.assert_allclose(blended, (fine_tuned + fast) / 2, rtol=1e-12)
    results = {arm: json.loads((run / "result.json").read_text()) for arm, run in runs.items()}
    assert results["blend"]["wall_s"] == results["finetuned"]["wall_s"] + results["frozen"]["wall_s"]
    val = pd.read_csv(split_file.with_suffix(".val.csv"))[TARGET].to_numpy()
    fast_val = pd.read_csv(runs["frozen"] / "val_predictions.csv")["prediction"].to_numpy()
    assert results["frozen"]["val_rmse"] == float(np.sqrt(np.mean((fast_val - val) ** 2)))
    (row,) = json.loads(done.stdout.strip().splitlines()[-1])["rows"]
    assert row["arm"] == "blend" and row["test_rmse"] == [results["blend"]["test_rmse"]]

"""One recipe for any CSV: ``configs/csv.yaml`` as it is, with ``--data.init_args.task
classification`` or ``multiclass``, trains through the installed ``graphormer-urpe fit`` on real
molecules (ESOL's solubility cut into classes); the recipe's regression loss gives way to the
task's own, said in one log line."""
from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
ESOL_TARGET = "measured log solubility in mols per litre"

#: task -> (its own loss as the log line names it, the metric that selects checkpoints)
TASKS = {"classification": ("binary cross-entropy", "val/auroc"), "multiclass": ("cross-entropy", "val/accuracy")}


def classes_of(log_s: pd.Series, task: str) -> pd.Series:
    """Poorly soluble (logS < -3) as class 1; for multiclass three classes, cut at -4 and -2."""
    if task == "classification":
        return (log_s < -3).astype(int)
    return pd.cut(log_s, [-float("inf"), -4, -2, float("inf")], labels=False).astype(int)


@pytest.mark.slow
@pytest.mark.parametrize("task", sorted(TASKS))
def test_csv_recipe_trains_a_class_column_with_the_tasks_own_loss(task, esol_csv, tmp_path):
    table = pd.read_csv(esol_csv)
    labelled = tmp_path / "esol_classes.csv"
    pd.DataFrame({"smiles": table["smiles"], "soluble_class": classes_of(table[ESOL_TARGET], task)}).to_csv(
        labelled, index=False)
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [str(BIN / "graphormer-urpe"), "fit", "--config", "configs/csv.yaml",
         "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
         "--trainer.default_root_dir", str(run_dir), "--data.init_args.path", str(labelled),
         "--data.init_args.cache_root", str(tmp_path / "cache"),
         "--data.init_args.target_columns", "[soluble_class]", "--data.init_args.task", task,
         "--trainer.max_steps", "3", "--trainer.val_check_interval", "3", "--trainer.limit_val_batches", "2"],
        cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    own_loss, monitor = TASKS[task]
    assert f"model.loss mse is for regression targets: this {task} model trains with {own_loss}" in done.stderr

    last = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert last["global_step"] == 3 and last["hyper_parameters"]["facts"]["task"] == task
    with open(next(run_dir.rglob("metrics.csv"))) as f:
        logged = [row for row in csv.DictReader(f) if row.get(monitor)]
    assert logged and 0.0 <= float(logged[-1][monitor]) <= 1.0

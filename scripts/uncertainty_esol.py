"""How well does the spread of an ensemble flag its bad predictions? ESOL, scaffold split.

1. Train ``--seeds`` models with one recipe (``configs/esol.yaml`` + ``configs/esol_finetune.yaml``
   from scratch: ZINC featurizer, 2 x 64, 50 epochs, lr 1e-3; each its own seed, the same
   scaffold split), one torch thread each, ``--jobs`` at a time. A run whose checkpoint exists is
   not repeated.
2. Predict the split's test molecules with the installed command, once with every best-validation
   checkpoint together (``graphormer-urpe-predict --ckpt A B ...``: their mean and ``std``
   columns) and once with each alone.
3. Score: test RMSE of each model and of the mean; how the std ranks the errors (Spearman's rank
   correlation of std with |error|; RMSE of the half with the smallest std against the other
   half); how often the measured value lies within 1 and 2 std of the mean, also after scaling
   the std by one factor fitted on the validation split (the installed command's ``--calibrate``:
   the RMS of error / std there). Print the
   table and a final JSON line, and write both to ``<work>/uncertainty_esol.{md,json}``.

    python scripts/uncertainty_esol.py [--work runs/uncertainty_esol] [--seeds 0 1 2 3 4] [--jobs 2]
"""
from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from finetune_esol import ESOL_CONFIGS, SHARED, checkpoint_state, cli  # noqa: E402  (the same recipe and runner)

ESOL = SHARED / "moleculenet" / "esol.csv"
TARGET = "measured log solubility in mols per litre"
PREDICT = Path(sys.executable).with_name("graphormer-urpe-predict")


def train(work: Path, seed: int) -> Path:
    """The best-validation checkpoint of seed ``seed`` (trained unless its run finished before)."""
    run = work / f"seed{seed}"
    done = run / "best.txt"
    if not done.is_file():
        cli(["fit", *ESOL_CONFIGS, "--seed_everything", str(seed), "--data.init_args.split", "scaffold",
             "--data.init_args.encode_threads", "1", "--data.init_args.build_workers", "1",
             "--model.freeze_backbone_steps", "0", "--trainer.default_root_dir", str(run),
             "--trainer.enable_progress_bar", "false", "--checkpoint.overwrite", "true"], run / "fit.log")
        _, state = checkpoint_state(run / "checkpoints" / "last.ckpt")
        done.write_text(state["best_model_path"])
        print(f"seed {seed}: best validation MAE {float(state['best_model_score']):.4f}", flush=True)
    return Path(done.read_text())


def write_splits(work: Path, splits: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Each scaffold split of ESOL in ``splits`` (as the runs' DataModule splits it) as a CSV of
    SMILES and measured values, ``<work>/<split>_smiles.csv``; returns the measured values."""
    from graphormer_urpe.data import CSVDataModule

    data = CSVDataModule(path=str(ESOL), target_columns=[TARGET], split="scaffold",
                         featurizer="zinc", encode_threads=1, build_workers=1,
                         cache_root=str(work / "cache"))
    smiles, y, _ = data._read()
    rows_of = data.store()[3]
    measured = {}
    for split in splits:
        rows = rows_of[split]
        with open(work / f"{split}_smiles.csv", "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["smiles", TARGET])
            writer.writerows([smiles[row], y[row][0]] for row in rows)
        measured[split] = np.asarray(y, dtype=np.float64)[rows, 0]
    return measured


def predict(ckpts: list[Path], source: Path, output: Path, *extra: str) -> tuple[np.ndarray, np.ndarray | None]:
    """The installed command's mean (and std, for several checkpoints) per molecule."""
    subprocess.run([str(PREDICT), "--ckpt", *map(str, ckpts), "--input", str(source), "--output",
                    str(output), "--quiet", "--workers", "1", *extra], check=True)
    with open(output, newline="") as handle:
        rows = list(csv.DictReader(handle))
    if any(row["error"] for row in rows):
        raise SystemExit(f"{output}: rows without a prediction")
    mean = np.array([float(row[f"prediction_{TARGET}"]) for row in rows])
    std = np.array([float(row[f"std_{TARGET}"]) for row in rows]) if len(ckpts) > 1 else None
    return mean, std


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    rank = lambda v: np.argsort(np.argsort(v)).astype(float)  # noqa: E731  (no ties in floats here)
    return float(np.corrcoef(rank(a), rank(b))[0, 1])


def rmse(error: np.ndarray) -> float:
    return float(np.sqrt(np.mean(error ** 2)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "uncertainty_esol")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--jobs", type=int, default=2, help="runs trained at a time")
    args = parser.parse_args()
    if len(args.seeds) < 2:
        parser.error("an ensemble needs at least two --seeds")
    args.work.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(args.jobs) as pool:
        ckpts = list(pool.map(lambda seed: train(args.work, seed), args.seeds))
    measured = write_splits(args.work, ("test", "val"))
    source, y = args.work / "test_smiles.csv", measured["test"]
    mean, std = predict(ckpts, source, args.work / "ensemble.csv")
    # One scale for the std, fitted on the validation split (the Gaussian likelihood's best s:
    # the RMS of error / std there), then judged on the test split.
    _, scaled_std = predict(ckpts, source, args.work / "ensemble_calibrated.csv",
                            "--calibrate", str(args.work / "val_smiles.csv"))
    scale = float(np.median(scaled_std / std))
    singles = [rmse(predict([ckpt], source, args.work / f"seed{seed}.csv")[0] - y)
               for seed, ckpt in zip(args.seeds, ckpts)]
    error = np.abs(mean - y)
    confident = std <= np.median(std)
    result = {
        "molecules": len(y), "seeds": args.seeds,
        "single_rmse_mean": float(np.mean(singles)), "single_rmse_std": float(np.std(singles)),
        "single_rmse": [round(v, 4) for v in singles], "ensemble_rmse": rmse(mean - y),
        "spearman_std_abs_error": spearman(std, error),
        "rmse_lower_half_std": rmse(error[confident]), "rmse_upper_half_std": rmse(error[~confident]),
        "within_1_std": float(np.mean(error <= std)), "within_2_std": float(np.mean(error <= 2 * std)),
        "median_std": float(np.median(std)),
        "std_scale_from_val": scale, "within_1_scaled_std": float(np.mean(error <= scaled_std)),
        "within_2_scaled_std": float(np.mean(error <= 2 * scaled_std)),
    }
    table = "\n".join([
        f"ESOL scaffold split, {len(y)} test molecules, {len(args.seeds)} models (seeds "
        f"{', '.join(map(str, args.seeds))}), configs/esol.yaml + configs/esol_finetune.yaml from scratch",
        "",
        "| measure | value |",
        "| --- | ---: |",
        f"| test RMSE, one model (mean ± std over seeds) | {result['single_rmse_mean']:.3f} ± {result['single_rmse_std']:.3f} |",
        f"| test RMSE, ensemble mean | {result['ensemble_rmse']:.3f} |",
        f"| Spearman rank correlation of std with abs. error | {result['spearman_std_abs_error']:.2f} |",
        f"| test RMSE, half with the smallest std | {result['rmse_lower_half_std']:.3f} |",
        f"| test RMSE, half with the largest std | {result['rmse_upper_half_std']:.3f} |",
        f"| measured value within 1 std / 2 std of the mean | {result['within_1_std']:.0%} / {result['within_2_std']:.0%} |",
        f"| median std (log mol/L) | {result['median_std']:.3f} |",
        f"| std scale fitted on the validation split (RMS of error / std there) | {scale:.2f} |",
        f"| measured value within 1 / 2 scaled std of the mean | {result['within_1_scaled_std']:.0%} / {result['within_2_scaled_std']:.0%} |",
    ])
    print(table)
    (args.work / "uncertainty_esol.md").write_text(table + "\n")
    (args.work / "uncertainty_esol.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()

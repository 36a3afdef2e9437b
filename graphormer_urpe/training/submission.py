"""An OGB-LSC PCQM4M / PCQM4Mv2 submission from a Lightning checkpoint (``graphormer-urpe-submit``,
:mod:`graphormer_urpe.cli.submit`): the split dict checked, the valid MAE by OGB's evaluator,
every test set predicted by Lightning's predict loop and checked, and only then the files
written by the evaluator's ``save_test_submission``, put in place together and each whole."""
from __future__ import annotations

import contextlib
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from graphormer_urpe.data.lsc_layouts import LAYOUTS, LSCLayout
from graphormer_urpe.data.ogb_lsc import read_split_dict, require_layout
from graphormer_urpe.utils.files import AtomicFile, commit_together


class SubmissionError(ValueError):
    """Input that cannot give a valid submission (exit status 2)."""


def predict_split(module, data, split: str, trainer) -> tuple[np.ndarray, np.ndarray]:
    """Predictions ``[R]`` float32 for the rows of OGB split ``split`` in split order, and their
    labels ``[R]`` (NaN in the test sets)."""
    import torch

    outputs = trainer.predict(module, dataloaders=data.ogb_split_loader(split))
    index = torch.cat([o["index"] for o in outputs]).numpy()
    pred = torch.cat([o["prediction"] for o in outputs]).squeeze(-1).float().numpy()
    order = np.argsort(index, kind="stable")
    if not np.array_equal(index[order], np.arange(len(index))):
        raise RuntimeError(f"{split}: predictions do not cover each row exactly once")
    labels = data.table_split(split).y.reshape(-1)
    return pred[order], np.asarray(labels, dtype=np.float32)


def check_test_sizes(splits: dict[str, np.ndarray], layout: LSCLayout) -> None:
    """The test sets must have OGB's official sizes (its evaluator and leaderboard expect them)."""
    for split in layout.test_splits:
        expected = layout.split_sizes[split]
        if len(splits[split]) != expected:
            raise SubmissionError(f"split {split!r} has {len(splits[split]):,} rows; the official "
                                  f"{layout.name} {split} set has {expected:,}")


def submit(args) -> dict:
    """Validate, predict and write; returns the summary. Raises :class:`SubmissionError` /
    ``ValueError`` (e.g. ``predict.CheckpointError``) for refused input."""
    import lightning.pytorch as pl
    import ogb.lsc

    from graphormer_urpe.data import PCQM4MDataModule, PCQM4Mv2DataModule
    from graphormer_urpe.training.module import load_training_module

    layout = LAYOUTS[args.dataset]
    require_layout(args.root, layout)
    module = load_training_module(args.ckpt)
    facts = module.facts
    if facts.featurizer != "ogb" or facts.num_targets != 1 or facts.task != "regression":
        raise SubmissionError(f"{args.ckpt} was trained for {facts.task} with featurizer "
                              f"{facts.featurizer!r} and {facts.num_targets} targets; "
                              f"{layout.name} needs an 'ogb'-featurized single-target regression model")
    if args.out_dir.exists() and not args.out_dir.is_dir():
        raise SubmissionError(f"--out-dir {args.out_dir} exists and is not a directory")

    started = time.perf_counter()
    check_test_sizes(read_split_dict(args.root, layout), layout)  # before featurizing
    data_class = next(c for c in (PCQM4MDataModule, PCQM4Mv2DataModule) if c.layout is layout)
    params = facts.encoding_params
    data = data_class(root=args.root, eval_batch_size=args.batch_size, **params.as_dict())
    _, _, _, splits = data.store()  # checks the split dict against the table
    for split in ("train", "valid"):
        if len(splits[split]) != layout.split_sizes[split]:
            print(f"note: {split} has {len(splits[split]):,} rows (official {layout.name}: "
                  f"{layout.split_sizes[split]:,})", file=sys.stderr)

    trainer = pl.Trainer(accelerator=args.accelerator, devices=1, precision=args.precision, logger=False,
                         enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False)
    evaluator = getattr(ogb.lsc, layout.ogb_evaluator)()
    valid_pred, valid_true = predict_split(module, data, "valid", trainer)
    valid_mae = float(evaluator.eval({"y_pred": valid_pred, "y_true": valid_true})["mae"])
    if not math.isfinite(valid_mae):
        raise SubmissionError(f"valid MAE is {valid_mae}: {int((~np.isfinite(valid_pred)).sum()):,} of "
                              f"{len(valid_pred):,} valid predictions are not finite (a damaged or diverged model)")
    print(f"valid MAE ({len(valid_pred):,} molecules): {valid_mae:.4f}")

    test_preds = {}
    for split in layout.test_splits:
        pred, _ = predict_split(module, data, split, trainer)
        if len(pred) != layout.split_sizes[split]:
            raise SubmissionError(f"{split} has {len(pred):,} predictions, OGB expects {layout.split_sizes[split]:,}")
        if not np.isfinite(pred).all():
            raise SubmissionError(f"{split} has {int((~np.isfinite(pred)).sum()):,} non-finite predictions")
        test_preds[split] = pred

    summary = {"dataset": args.dataset, "ckpt": str(args.ckpt), "valid_mae": valid_mae,
               "valid_count": len(valid_pred)}
    files = write_submission(evaluator, test_preds, args.out_dir, by_mode=layout.test_splits != ("test",))
    for split, pred in test_preds.items():
        summary[f"{split}_count"] = len(pred)
        print(f"{split}: {len(pred):,} predictions written to {args.out_dir}")
    summary["files"] = files
    summary["seconds"] = round(time.perf_counter() - started, 1)
    return summary


def write_submission(evaluator, test_preds: dict[str, np.ndarray], out_dir: Path, by_mode: bool) -> list[str]:
    """The evaluator's files (``save_test_submission``, with ``mode=split`` when ``by_mode``) of
    every test set, put in ``out_dir`` together (:func:`~graphormer_urpe.utils.files.commit_together`):
    a stop or a failure leaves every previous file as it was, never a truncated ``.npz`` nor the
    files of two models side by side. Returns their names."""
    out_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".submission.tmp-", dir=out_dir))
    try:
        for split, pred in test_preds.items():  # written only once every split passed
            mode = {"mode": split} if by_mode else {}
            evaluator.save_test_submission({"y_pred": pred}, dir_path=str(staging), **mode)
        with contextlib.ExitStack() as stack:
            outputs = [stack.enter_context(AtomicFile(out_dir / written.name, binary=True))
                       for written in sorted(staging.iterdir())]
            for output in outputs:
                output.handle.write((staging / output.path.name).read_bytes())
            commit_together(outputs)
        return [output.path.name for output in outputs]
    finally:
        shutil.rmtree(staging, ignore_errors=True)

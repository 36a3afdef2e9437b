"""``graphormer-urpe-predict``: predictions for SMILES from a Lightning checkpoint.

    graphormer-urpe-predict --ckpt runs/zinc_urpe/checkpoints/last.ckpt --input mols.csv --output preds.csv

The input is a CSV with a ``smiles`` column (any case) or a text file with one SMILES a line. The
output CSV has one row per input row, in input order: ``row`` (1-based data row), ``smiles``, the
prediction (``prediction`` or ``prediction_<k>`` for several targets) and ``error``. A SMILES that
RDKit cannot parse, or whose graph is larger than ``--max-nodes``, gets an empty prediction and
its error; every other row is still predicted.
"""
from __future__ import annotations

import argparse
import csv
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable or not a graphormer-urpe model."""


@dataclass
class InputRow:
    smiles: str  #: as given (echoed to the output); parsed without surrounding white space
    error: str = ""


def read_smiles(path: str | Path) -> list[InputRow]:
    """Rows of a CSV with a ``smiles`` column, or of a file with one SMILES a line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"input file {path} does not exist")
    with open(path, newline="") as handle:
        first = handle.readline()
        handle.seek(0)
        header = [c.strip().lower() for c in next(csv.reader([first]), [])]
        if path.suffix.lower() == ".csv" or (len(header) > 1 and "smiles" in header):
            reader = csv.reader(handle)
            header = [c.strip().lower() for c in next(reader, [])]
            if "smiles" not in header:
                raise ValueError(f"{path}: CSV header {header} has no 'smiles' column")
            column = header.index("smiles")
            return [InputRow(row[column] if column < len(row) else "") for row in reader]
        return [InputRow(line) for line in handle.read().splitlines()]


def load_module(ckpt: str | Path, map_location: str = "cpu"):
    """The :class:`GraphormerModule` stored in a Lightning checkpoint, in eval mode."""
    from graphormer_urpe.training.module import GraphormerModule

    ckpt = Path(ckpt)
    if not ckpt.is_file():
        raise CheckpointError(f"checkpoint {ckpt} does not exist")
    try:
        # weights_only: a checkpoint is data, never code to run (our hparams are plain values).
        checkpoint = torch.load(ckpt, map_location=map_location, weights_only=True)
    except Exception as exc:  # truncated zip, not a torch file, ...
        raise CheckpointError(f"checkpoint {ckpt} cannot be read ({type(exc).__name__}: {exc})") from exc
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint \
            or "hyper_parameters" not in checkpoint:
        raise CheckpointError(f"{ckpt} is not a Lightning checkpoint (no state_dict/hyper_parameters)")
    hparams = dict(checkpoint["hyper_parameters"])
    hparams.pop("_instantiator", None)
    hparams.pop("_class_path", None)
    hparams["compile"] = False  # inference needs no compile warm-up, whatever training used
    try:
        module = GraphormerModule(**hparams)
        module.load_state_dict(checkpoint["state_dict"])
    except (TypeError, RuntimeError, KeyError, ValueError) as exc:
        raise CheckpointError(
            f"checkpoint {ckpt} does not match this version's GraphormerModule: {exc}") from exc
    return module.eval()


def predict_smiles(module, rows: list[InputRow], max_nodes: int = 512,
                   batch_size: int = 256) -> np.ndarray:
    """``[len(rows), num_targets]`` predictions; NaN (with ``row.error`` set) where impossible."""
    from graphormer_urpe.data.collate import collate_pyg_graphs
    from graphormer_urpe.data.featurize import featurizer_spec

    from rdkit import RDLogger

    RDLogger.DisableLog("rdApp.*")  # parse failures go into the output's error column instead
    spec = featurizer_spec(module.hparams.featurizer)
    out = np.full((len(rows), module.hparams.num_targets), np.nan, dtype=np.float32)
    graphs, positions = [], []
    for position, row in enumerate(rows):
        if not row.smiles.strip():
            row.error = "empty SMILES"
            continue
        try:
            graph = spec.from_smiles(row.smiles.strip())
        except ValueError as exc:
            row.error = str(exc)
            continue
        if graph.num_nodes > max_nodes:
            row.error = f"molecule has {graph.num_nodes} atoms, more than max_nodes={max_nodes}"
            continue
        graphs.append(graph)
        positions.append(position)
    device = next(module.parameters()).device
    with torch.inference_mode():
        for start in range(0, len(graphs), batch_size):
            batch = collate_pyg_graphs(graphs[start:start + batch_size], module.hparams.max_hops,
                                       spec.atom_feature_dims, spec.bond_feature_dims)
            pred = module.predict_step(batch.to(device), 0)["prediction"]
            out[positions[start:start + batch_size]] = pred.float().cpu().numpy()
    return out


def write_predictions(path: str | Path, rows: list[InputRow], predictions: np.ndarray) -> None:
    num_targets = predictions.shape[1]
    names = ["prediction"] if num_targets == 1 else [f"prediction_{k}" for k in range(num_targets)]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["row", "smiles", *names, "error"])
        for number, (row, pred) in enumerate(zip(rows, predictions), start=1):
            values = ["" if row.error else f"{v:.6g}" for v in pred]
            writer.writerow([number, row.smiles, *values, row.error])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="graphormer-urpe-predict", description=__doc__.split("\n")[0])
    parser.add_argument("--ckpt", required=True, help="Lightning checkpoint (.ckpt) of any config")
    parser.add_argument("--input", required=True, help="CSV with a 'smiles' column, or one SMILES a line")
    parser.add_argument("--output", required=True, help="CSV to write")
    parser.add_argument("--max-nodes", type=int, default=512,
                        help="larger molecules get an error row instead of a prediction")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        module = load_module(args.ckpt).to(args.device)
        rows = read_smiles(args.input)
    except (CheckpointError, FileNotFoundError, ValueError) as exc:
        print(f"graphormer-urpe-predict: error: {exc}", file=sys.stderr)
        return 2
    predictions = predict_smiles(module, rows, args.max_nodes, args.batch_size)
    write_predictions(args.output, rows, predictions)
    failed = sum(bool(r.error) for r in rows)
    log.info("wrote %d rows to %s (%d without prediction)", len(rows), args.output, failed)
    return 0


if __name__ == "__main__":
    sys.exit(main())

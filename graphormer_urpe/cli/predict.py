"""``graphormer-urpe-predict``: predictions for SMILES from a Lightning checkpoint.

    graphormer-urpe-predict --ckpt runs/zinc_urpe/checkpoints/last.ckpt --input mols.csv --output preds.csv

With several checkpoints of one task (``--ckpt A.ckpt B.ckpt C.ckpt``: the same recipe trained
with other seeds; a run directory stands for its best-validation checkpoint, and a folder of run
directories, such as an ensemble's or an ablation's, for the best checkpoint of each) the prediction columns hold the models' mean, and a ``std...`` column after
them holds each target's standard deviation over the models (``prediction_logS`` ->
``std_logS``): how much models trained alike disagree on that molecule, a first sign of an
unreliable prediction (``docs/uncertainty.md`` measures how well it ranks the errors).
``--mc-dropout N`` gives the same columns from one checkpoint trained with dropout: N predictions
with dropout on (Monte Carlo dropout), their mean and standard deviation. ``--calibrate VAL.csv``
scales each std by the factor that fits the errors on labelled held-out molecules (their
measured values in the columns of the model's targets), so it can be read as a Gaussian error bar.

Input: a CSV whose header has a ``smiles`` column (any case), or any other file with one SMILES
a line (UTF-8, a byte-order mark is ignored). Output: one CSV row per input row, in input order:
``row`` (1-based data row), the input's columns (``smiles`` for a one-SMILES-a-line file), one
prediction column per target (``prediction_<target name>`` when the checkpoint records its
targets' names, else ``prediction`` / ``prediction_<k>``) and ``error``. An input column whose
name the output uses gets the prefix ``input_``. A row whose SMILES is empty, rejected by RDKit,
contains white space (RDKit would silently read only its first word) or a character that is
not ASCII (RDKit reads ``CCÖ`` as ``CC``), has an atom outside the featurizer's vocabulary, or is larger than ``--max-nodes`` gets an empty prediction and the
reason; every other row is still predicted.

Embeddings (``--embeddings FILE.npy``, ``--atom-embeddings FILE.npz``,
:mod:`~graphormer_urpe.prediction.embeddings`, ``docs/embeddings.md``): each row's graph-token
vector, the one the output head reads (float32 ``[rows, D]``, a row of NaN where the table has no
prediction), and each atom's (``embeddings [atoms, D]`` with ``offsets [rows + 1]``), from one
model (a checkpoint, a run directory or ``pretrained:<name>``; several ``--ckpt`` or
``--mc-dropout`` are refused), streamed, and put in place together with the table: all of them
or, on any failure, none (the previous files stay as they were).

Safety: the output is written to a temporary file beside it and renamed at the end, so a failure
never leaves a truncated table nor destroys a previous one; an output that is the input file or
the checkpoint (however spelled: a symbolic or hard link too), or that cannot be written, is
refused before any work. A checkpoint is verified before use
(:func:`~graphormer_urpe.prediction.load.load_module`): zip CRCs, finite weights,
hyperparameters that build this version's model (exit 2 otherwise).

Memory and speed: the input is streamed in chunks of ``--chunk-rows`` rows; ``--workers``
processes featurize them and, on the CPU, predict them with one torch thread each (the model is
loaded without Lightning, :class:`~graphormer_urpe.prediction.model.PredictionModel`). Within a
chunk molecules are sorted by size and batched so a batch holds at most ``--max-pairs`` padded
node pairs ``B * (N + 1)^2`` (and ``--batch-size`` molecules), so peak memory is bounded by the
larger of ``--max-pairs`` and ``(max_nodes + 1)^2`` whatever the input's length.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import logging
import sys
from pathlib import Path
from typing import TextIO

import numpy as np
import torch

from graphormer_urpe.cli.arguments import non_negative_int, positive_int
from graphormer_urpe.utils.process import usable_cores
from graphormer_urpe.utils.files import AtomicFile, commit_together, refuse_overwriting_inputs, unreadable_as_a_file
from graphormer_urpe.utils.process import run_command
from graphormer_urpe.utils.torch_files import CheckpointError
from graphormer_urpe.prediction.embeddings import (
    ATOM_OPTION, GRAPH_OPTION, EmbeddingFiles, check_embedding_paths)
from graphormer_urpe.prediction.load import checkpoint_files, load_models
from graphormer_urpe.prediction.model import (
    DEFAULT_BATCH_SIZE, DEFAULT_MAX_NODES, DEFAULT_MAX_PAIRS, MCDropout, ScaledStd, WithEmbeddings,
    stream_predictions)
from graphormer_urpe.prediction.table import (
    PredictionTable, count_lines, open_smiles, prediction_columns)
from graphormer_urpe.prediction.workers import WorkerDied

log = logging.getLogger(__name__)

#: Bytes per padded pair a predicting process needs for Graphormer-slim (measured, README).
_SLIM_BYTES_PER_PAIR = 200
DEFAULT_CHUNK_ROWS = 1024


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="graphormer-urpe-predict", description=__doc__.split("\n")[0],
        epilog="Peak memory: a batch holds at most max(--max-pairs, (--max-nodes + 1)^2) padded node "
               "pairs; each predicting process (each worker on the CPU) needs "
               f"~{_SLIM_BYTES_PER_PAIR / 1000:.1f} KB per pair for the slim model "
               f"(~{max(DEFAULT_MAX_PAIRS, (DEFAULT_MAX_NODES + 1) ** 2) * _SLIM_BYTES_PER_PAIR / 1e6:.0f} MB "
               "at the defaults) on top of ~0.4 GB "
               "of libraries and model, whatever the input's length. Lower --max-pairs and --max-nodes "
               "for bigger models or smaller machines.")
    parser.add_argument("--ckpt", required=True, nargs="+", metavar="CKPT",
                        help="Lightning checkpoint (.ckpt) of any config, or a run directory (its "
                             "best-validation checkpoint) or a folder of run directories (an ablation "
                             "grid, an ensemble's members: the best of each); several (the same task "
                             "trained with other seeds): their mean, and std columns")
    parser.add_argument("--mc-dropout", type=positive_int, default=None, metavar="N",
                        help="one checkpoint predicting N times with its dropout on: the mean, and "
                             "std columns (a model trained with dropout; masks seeded by --seed)")
    parser.add_argument("--seed", type=non_negative_int, default=0,
                        help="seed of the --mc-dropout masks (default 0)")
    parser.add_argument("--evaluate", nargs="+", default=None, metavar="COLUMN",
                        help="input columns holding measured values, one per target (regression): "
                             "print RMSE, MAE and, with a std, how well it ranks and covers the "
                             "errors (one JSON line per target)")
    parser.add_argument("--calibrate", default=None, metavar="CSV",
                        help="molecules with measured values in the model's target columns, unseen "
                             "in training (e.g. the validation split): each std column is scaled "
                             "to fit their errors (needs a std: several --ckpt or --mc-dropout)")
    parser.add_argument("--input", required=True,
                        help="CSV with a 'smiles' column (other columns are kept), or one SMILES a line")
    parser.add_argument("--output", required=True, help="CSV to write (never the input nor the checkpoint)")
    parser.add_argument("--embeddings", default=None, metavar="FILE.npy",
                        help="also write each row's graph-token vector, the one the output head reads: "
                             "float32 [rows, D] in input order, NaN where there is no prediction (one "
                             "model only: no ensemble, no --mc-dropout)")
    parser.add_argument("--atom-embeddings", default=None, metavar="FILE.npz",
                        help="also write each atom's final vector: 'embeddings' [atoms, D] and "
                             "'offsets' [rows + 1]; row i's atoms (RDKit order) are "
                             "embeddings[offsets[i]:offsets[i+1]], none where there is no prediction")
    parser.add_argument("--max-nodes", type=positive_int, default=DEFAULT_MAX_NODES,
                        help="larger molecules get an error row instead of a prediction (default "
                             f"{DEFAULT_MAX_NODES})")
    parser.add_argument("--max-pairs", type=positive_int, default=DEFAULT_MAX_PAIRS,
                        help="padded node pairs B*(N+1)^2 per batch: bounds peak memory "
                             f"(default {DEFAULT_MAX_PAIRS})")
    parser.add_argument("--batch-size", type=positive_int, default=DEFAULT_BATCH_SIZE,
                        help=f"most molecules per batch (default {DEFAULT_BATCH_SIZE})")
    parser.add_argument("--workers", type=non_negative_int, default=usable_cores(),
                        help="processes that featurize and, on the CPU, predict with one torch thread "
                             "each; 0 = all in this process with torch's threads (default: the CPU "
                             "cores available)")
    parser.add_argument("--chunk-rows", type=positive_int, default=DEFAULT_CHUNK_ROWS,
                        help="rows read, sorted by size and batched together (default "
                             f"{DEFAULT_CHUNK_ROWS})")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="torch device (default: cuda when available, else cpu)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def _check_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device {name!r} is not a torch device (e.g. cpu, cuda, cuda:1)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available here (torch {torch.__version__}, "
                         f"built for CUDA {torch.version.cuda}); use --device cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s)")
    return device


def _check_paths(source: Path, target: Path, ckpts: list[Path]) -> None:
    """The output is never a file the command reads: the input or a checkpoint (any spelling,
    symbolic or hard link)."""
    problem = unreadable_as_a_file(source)
    if problem:
        raise ValueError(f"--input {source} {problem}")
    if target.is_dir():
        raise IsADirectoryError(f"--output {target} is a directory")
    refuse_overwriting_inputs("--output", [target], [("--input", "input file", source),
                                                    *(("--ckpt", "checkpoint", ckpt) for ckpt in ckpts)])


def main(argv: list[str] | None = None) -> int:
    """The command: exit status 0; 2 for a refused input or output (one line, before any work);
    1 for a full disk or a worker process that died, 130 for Ctrl-C, 143 for SIGTERM, 129 for
    SIGHUP (one line, :func:`~graphormer_urpe.utils.process.run_command`; a previous output is left as
    it was)."""
    args = build_parser().parse_args(argv)
    return run_command("graphormer-urpe-predict", lambda: _predict_or_say_why_not(args))


def _predict_or_say_why_not(args: argparse.Namespace) -> int:
    try:
        return _predict(args)
    except WorkerDied as exc:  # its outputs were discarded on the way out
        print(f"graphormer-urpe-predict: error: {exc}; nothing written", file=sys.stderr)
        return 1


def _predict(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    source, target = Path(args.input), Path(args.output)
    calibration = Path(args.calibrate) if args.calibrate is not None else None
    embedding_paths = {option: Path(path) if path is not None else None
                       for option, path in ((GRAPH_OPTION, args.embeddings), (ATOM_OPTION, args.atom_embeddings))}
    embeddings = None
    try:
        device = _check_device(args.device)
        ckpts = checkpoint_files(args.ckpt)
        if ckpts != [Path(ckpt) for ckpt in args.ckpt]:  # a run directory stood for its best
            log.info("models: %s", ", ".join(map(str, ckpts)))
        for read in (source, calibration):
            if read is not None:
                _check_paths(read, target, ckpts)
        if any(embedding_paths.values()):
            _check_one_model(ckpts, args.mc_dropout)
            check_embedding_paths(embedding_paths, [
                ("--input", "input file", source), ("--calibrate", "calibration file", calibration),
                ("--output", "prediction table", target), *(("--ckpt", "checkpoint", c) for c in ckpts)])
        output = AtomicFile(target)  # fails now, not after the predictions, if unwritable
        if any(embedding_paths.values()):
            try:
                embeddings = EmbeddingFiles(*embedding_paths.values())
            except ValueError:
                output.discard()
                raise
    except (FileNotFoundError, ValueError, OSError, CheckpointError) as exc:
        print(f"graphormer-urpe-predict: error: {exc}", file=sys.stderr)
        return 2
    with output, embeddings or contextlib.nullcontext(), open(source, newline="", encoding="utf-8-sig") as handle:
        try:
            if args.mc_dropout is not None and len(ckpts) > 1:
                raise ValueError("--mc-dropout takes one checkpoint (several checkpoints already give a std)")
            module = load_models(ckpts)
            if embeddings is not None:
                module = WithEmbeddings(module, atoms=embedding_paths[ATOM_OPTION] is not None)
            if args.mc_dropout is not None:
                module = MCDropout(module, args.mc_dropout, args.seed, args.max_pairs)
            module = module.to(device)
            table_input = open_smiles(handle, source)
            if args.evaluate is not None:
                _check_evaluate(args.evaluate, table_input.columns, module, source, target)
            if calibration is not None:
                measured_columns = _check_calibrate(module, calibration)
        except (CheckpointError, ValueError, UnicodeDecodeError) as exc:
            print(f"graphormer-urpe-predict: error: {exc}", file=sys.stderr)
            return 2
        if calibration is not None:
            try:
                module = _calibrated(module, calibration, measured_columns, args)
            except (UnicodeDecodeError, csv.Error, ValueError) as exc:
                print(f"graphormer-urpe-predict: error: {calibration}: {exc}; nothing written",
                      file=sys.stderr)
                return 2
        table = PredictionTable(output.handle, prediction_columns(module), table_input.columns)
        try:
            _stream(module, table_input, table, source, args, "predict", embeddings)
            # every output of the run in place together, or none (new vectors never sit beside
            # an old table)
            commit_together([output, *(embeddings.assemble(module.width) if embeddings is not None else [])])
        except (UnicodeDecodeError, csv.Error) as exc:
            print(f"graphormer-urpe-predict: error: {source}: {exc}; nothing written", file=sys.stderr)
            return 2
        except OSError as exc:  # e.g. disk full: the previous output stays as it was
            written = ", ".join(map(str, [target, *(p for p in embedding_paths.values() if p is not None)]))
            print(f"graphormer-urpe-predict: error: cannot write {written}: {exc}; nothing written",
                  file=sys.stderr)
            return 1
    log.info("wrote %d rows to %s (%d without prediction)", table.rows_written, target, table.failed)
    for path in embedding_paths.values():
        if path is not None:
            log.info("wrote the embeddings of those rows to %s", path)
    if args.evaluate is not None:
        names, num_targets = prediction_columns(module), module.facts.num_targets
        for k, (measured, predicted, std) in enumerate(
                _read_back(args.evaluate, source, target, names, num_targets)):
            _report(names[k], args.evaluate[k], measured, predicted, std)
    return 0


def _check_one_model(ckpts: list[Path], mc_dropout: int | None) -> None:
    """Embeddings are one model's vectors: one checkpoint, no MC dropout (one line otherwise)."""
    if len(ckpts) > 1 or mc_dropout is not None:
        given = f"{len(ckpts)} checkpoints" if len(ckpts) > 1 else f"--mc-dropout {mc_dropout}"
        raise ValueError("--embeddings and --atom-embeddings come from one model: name one --ckpt (a "
                         f"checkpoint, a run directory or pretrained:<name>) without --mc-dropout (got {given})")


def _stream(module, table_input, table: PredictionTable, source: Path, args: argparse.Namespace,
            desc: str, embeddings: EmbeddingFiles | None = None) -> None:
    """Predict every row of ``table_input`` into ``table`` (and ``embeddings``), with a progress
    bar named ``desc``."""
    from tqdm import tqdm

    total = count_lines(source) - (table_input.columns is not None)
    with tqdm(total=max(total, 0), unit="mol", disable=args.quiet, file=sys.stderr,
              mininterval=1.0, desc=desc) as progress:
        stream_predictions(module, table_input.rows, table, max_nodes=args.max_nodes,
                           max_pairs=args.max_pairs, batch_size=args.batch_size,
                           chunk_rows=args.chunk_rows, workers=args.workers, progress=progress,
                           embeddings=embeddings)


def _check_regression(option: str, module) -> None:
    """``--calibrate`` and ``--evaluate`` compare predictions with measured values: a regression
    model's only (checked before any file is read)."""
    if module.facts.task != "regression":
        raise ValueError(f"{option} compares a regression model's predictions with measured values; "
                         f"this model's task is {module.facts.task!r}")


def _check_columns(option: str, path: Path, header: list[str] | None, columns: list[str]) -> None:
    """The CSV ``path`` (its ``header``) has the ``columns`` that hold the measured values."""
    if header is None:
        raise ValueError(f"{option} reads measured values from a CSV with a header; {path} is one SMILES a line")
    missing = [c for c in columns if c not in header]
    if missing:
        raise ValueError(f"{option}: {path} has no column(s) {missing} (columns: {header})")


def _check_calibrate(module, calibration: Path) -> list[str]:
    """``--calibrate`` scales the std of a regression model that predicts one and whose
    checkpoint names its targets: the measured columns, in target order."""
    if not getattr(module, "predicts_std", False):
        raise ValueError("--calibrate scales the std columns: give several --ckpt or --mc-dropout N")
    _check_regression("--calibrate", module)
    names = module.hparams.get("target_names")
    if not names:
        raise ValueError("--calibrate reads the measured values from the columns of the model's targets, "
                         "and this checkpoint records no target names")
    with open(calibration, newline="", encoding="utf-8-sig") as handle:
        header = open_smiles(handle, calibration).columns
    _check_columns("--calibrate", calibration, header, list(names))
    return list(names)


def _calibrated(module, calibration: Path, columns: list[str], args: argparse.Namespace) -> ScaledStd:
    """``module`` with each target's std scaled by :func:`~graphormer_urpe.prediction.uncertainty.std_scale`
    fitted on the molecules of ``calibration`` (predicted into memory, then read back: no
    temporary file, so a full or read-only temporary directory does not matter)."""
    import io

    from graphormer_urpe.prediction.uncertainty import std_scale

    names, num_targets = prediction_columns(module), module.facts.num_targets
    predicted = io.StringIO(newline="")
    with open(calibration, newline="", encoding="utf-8-sig") as handle:
        table_input = open_smiles(handle, calibration)
        _stream(module, table_input, PredictionTable(predicted, names, table_input.columns),
                calibration, args, "calibrate")
    predicted.seek(0)
    scales = []
    for k, (measured, prediction, std) in enumerate(
            _read_back(columns, calibration, predicted, names, num_targets)):
        scale, count = std_scale(measured, prediction, std)
        log.info("%s scaled by %.4g (fitted on %d molecules of %s)", names[num_targets + k], scale,
                 count, calibration)
        scales.append(scale)
    return ScaledStd(module, scales)


def _check_evaluate(columns: list[str], header: list[str] | None, module, source: Path, target: Path) -> None:
    """``--evaluate`` needs one measured column per target, and an output it can read back (a
    regular file)."""
    if target.exists() and not target.is_file():
        raise ValueError(f"--evaluate reads the predictions back from --output, so {target} must be a "
                         "regular file")
    _check_regression("--evaluate", module)
    _check_columns("--evaluate", source, header, columns)
    if len(columns) != module.facts.num_targets:
        raise ValueError(f"--evaluate needs one column per target: the model has {module.facts.num_targets}, "
                         f"got {len(columns)}")


def _numbers(values) -> np.ndarray:
    out = []
    for value in values:
        try:
            out.append(float(value))
        except (TypeError, ValueError):  # empty or not a number: not measured
            out.append(float("nan"))
    return np.array(out)


def _read_back(columns: list[str], source: Path, target: Path | TextIO, names: list[str], num_targets: int):
    """Per target: ``(measured, predicted, std or None)`` arrays, the measured values from
    ``source``'s ``columns`` and the predictions written to ``target`` (a file, or the text of
    one; same rows, in order)."""
    with open(source, newline="", encoding="utf-8-sig") as handle:
        measured = list(csv.DictReader(handle))
    with (open(target, newline="", encoding="utf-8") if isinstance(target, Path)
          else contextlib.nullcontext(target)) as handle:
        predicted = list(csv.DictReader(handle))
    for k, column in enumerate(columns):
        std = _numbers(r[names[num_targets + k]] for r in predicted) if len(names) > num_targets else None
        yield _numbers(r[column] for r in measured), _numbers(r[names[k]] for r in predicted), std


def _report(name: str, column: str, measured: np.ndarray, predicted: np.ndarray, std) -> None:
    """Score the predictions against the measured values (:mod:`..uncertainty`): a log line and
    a JSON line."""
    import json

    from graphormer_urpe.prediction.uncertainty import regression_scores

    scores = regression_scores(measured, predicted, std)
    log.info("%s against %s: %s", name, column, ", ".join(f"{key} {value:.4g}" for key, value in scores.items()))
    print(json.dumps({"prediction": name, "measured": column, **scores}))


if __name__ == "__main__":
    sys.exit(main())

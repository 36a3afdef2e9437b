"""``graphormer-urpe-predict``: predictions for SMILES from a Lightning checkpoint.

    graphormer-urpe-predict --ckpt runs/zinc_urpe/checkpoints/last.ckpt --input mols.csv --output preds.csv

Several checkpoints of one task (a run directory stands for its best-validation checkpoint, a
folder of run directories for the best of each) predict their mean, with a ``std_<target>``
column of the models' standard deviation after the predictions; ``--mc-dropout N`` gives the same
columns from one checkpoint trained with dropout, and ``--calibrate VAL.csv`` scales each std to
fit the errors on labelled held-out molecules, so it reads as a Gaussian error bar
(``docs/uncertainty.md``).

Input: a CSV whose header has a ``smiles`` column (any case), or one SMILES a line. Output: one
row per input row, in input order: ``row``, the input's columns (an output name gets the prefix
``input_``), one prediction column per target and ``error``. A row that cannot be predicted (empty,
rejected by RDKit, white space or non-ASCII that RDKit would misread, an atom outside the
vocabulary, more than ``--max-nodes`` atoms, a line over the CSV reader's limit) gets an empty
prediction and the reason; every other row is still predicted. ``--embeddings`` and
``--atom-embeddings`` also write one model's vectors (``docs/embeddings.md``).

The outputs are put in place together at the end, or none; an output that is a file the command
reads, and a checkpoint that fails its checks, are refused before any work; peak memory is bounded
by ``--max-pairs`` whatever the input's length (:mod:`~graphormer_urpe.prediction.run`).
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import json
import logging
import os
import shutil
import sys
import tempfile
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import numpy as np

from graphormer_urpe.cli.arguments import non_negative_int, positive_int, refuse_overwriting_inputs
from graphormer_urpe.prediction.load import checkpoint_files, load_models
from graphormer_urpe.prediction.model import DEFAULT_BATCH_SIZE, DEFAULT_MAX_NODES, DEFAULT_MAX_PAIRS, ChunkOutput
from graphormer_urpe.prediction.run import (
    DEFAULT_CHUNK_ROWS, Streaming, check_device, check_mc_dropout, default_device, predicting, stream)
from graphormer_urpe.prediction.table import InputRow, PredictionTable, prediction_columns, read_smiles
from graphormer_urpe.prediction.uncertainty import calibrated, check_calibrate, check_evaluate, evaluation
from graphormer_urpe.utils.files import (
    AtomicFile, commit_together, unreadable_as_a_file, written_in_place)
from graphormer_urpe.utils.workers import WorkerDied, ran_out_of_memory, useful_workers
from graphormer_urpe.utils.process import run_command, usable_cores
from graphormer_urpe.utils.torch_files import CheckpointError

PROG = "graphormer-urpe-predict"
log = logging.getLogger(__name__)

#: Bytes per padded pair a predicting process needs for Graphormer-slim (measured, README).
SLIM_BYTES_PER_PAIR = 200
#: What a run's peak memory depends on, in the options' words.
PEAK_MEMORY = ("Peak memory: a batch holds at most max(--max-pairs, (--max-nodes + 1)^2) padded node "
               "pairs; each predicting process (each worker on the CPU) needs "
               f"~{SLIM_BYTES_PER_PAIR / 1000:.1f} KB per pair for the slim model "
               f"(~{max(DEFAULT_MAX_PAIRS, (DEFAULT_MAX_NODES + 1) ** 2) * SLIM_BYTES_PER_PAIR / 1e6:.0f} MB "
               "at the defaults) on top of ~0.4 GB "
               "of libraries and model, whatever the input's length. Lower --max-pairs and --max-nodes "
               "for bigger models or smaller machines.")
#: ``(option, suffix)`` of each embeddings output.
GRAPH_OPTION, ATOM_OPTION = ("--embeddings", ".npy"), ("--atom-embeddings", ".npz")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0], epilog=PEAK_MEMORY)
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
                        help="also write each row's vector that the output head reads (the graph token's, "
                             "the atoms' sum or both, as the model's readout): "
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
                             "each, at most one per CPU core available and per --chunk-rows rows; 0 = "
                             "all in this process with torch's threads (default: the CPU cores available)")
    parser.add_argument("--chunk-rows", type=positive_int, default=DEFAULT_CHUNK_ROWS,
                        help="rows read, sorted by size and batched together (default "
                             f"{DEFAULT_CHUNK_ROWS})")
    parser.add_argument("--device", default=default_device(),
                        help="torch device (default: cuda when available, else cpu)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


class _Exit(Exception):
    """Ends the command: exit status ``status``, its one line on stderr."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@contextlib.contextmanager
def _exit_on(errors, status: int = 2, about: str = "", after: str = ""):
    """The ``errors`` raised in the block end the command: ``status``, one line ``about`` them."""
    try:
        yield
    except errors as exc:
        raise _Exit(status, f"{about}{exc}{after}") from None


def main(argv: list[str] | None = None) -> int:
    """Exit status 0; 2 for a refused input or output (one line, before any work); 1 for a full
    disk, a worker process that died or memory that ran out; 128 + the signal for a stop
    (:func:`~graphormer_urpe.utils.process.run_command`; a previous output is left as it was)."""
    args = build_parser().parse_args(argv)
    return run_command(PROG, lambda: _predict_or_say_why_not(args))


def _predict_or_say_why_not(args: argparse.Namespace) -> int:
    try:
        with _exit_on(WorkerDied, status=1, after="; nothing written"):  # its outputs discarded on the way out
            try:
                return _predict(args)
            except Exception as exc:  # noqa: BLE001 - torch and oneDNN say so in a RuntimeError
                if not ran_out_of_memory(exc):
                    raise
                what = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                workers = useful_workers(args.workers)
                lower = [f"--max-pairs (now {args.max_pairs})", f"--batch-size (now {args.batch_size})",
                         *([f"--workers (now {workers})"] if workers > 1 else [])]
                raise _Exit(1, f"ran out of memory ({what}); lower {', '.join(lower[:-1])} or {lower[-1]}; "
                               "nothing written") from None
    except _Exit as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return exc.status


def _predict(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    source, target = Path(args.input), Path(args.output)
    calibration = Path(args.calibrate) if args.calibrate is not None else None
    graph, atoms = (Path(path) if path is not None else None for path in (args.embeddings, args.atom_embeddings))
    # the device, the checkpoints, the inputs and the outputs (opened), before any work
    with _exit_on((FileNotFoundError, ValueError, OSError, CheckpointError)):
        device = check_device(args.device)
        ckpts = checkpoint_files(args.ckpt)
        if ckpts != [Path(ckpt) for ckpt in args.ckpt]:  # a run directory stood for its best
            log.info("models: %s", ", ".join(map(str, ckpts)))
        check_files(source, target, ckpts, calibration=calibration, graph=graph, atoms=atoms,
                    mc_dropout=args.mc_dropout)
        outputs = Outputs(target, graph, atoms)
    workers = useful_workers(args.workers)
    if workers < args.workers:
        log.info("--workers %d is more than the %d cores this process may use: at most %d worker processes",
                 args.workers, workers, workers)
    streaming = Streaming(args.max_nodes, args.max_pairs, args.batch_size, args.chunk_rows, workers, args.quiet)
    with outputs, contextlib.ExitStack() as held:
        with _exit_on((CheckpointError, ValueError, UnicodeDecodeError)):
            check_mc_dropout(len(ckpts), args.mc_dropout)  # before any checkpoint is read
            module = predicting(load_models(ckpts), device, mc_dropout=args.mc_dropout, seed=args.seed,
                                max_pairs=args.max_pairs, embeddings=outputs.embeddings is not None,
                                atoms=atoms is not None)
            table_input = held.enter_context(read_smiles(source))
            if args.evaluate is not None:
                check_evaluate(args.evaluate, table_input.columns, module, source, target)
            measured = check_calibrate(module, calibration) if calibration is not None else None
        if calibration is not None:
            with _exit_on((UnicodeDecodeError, csv.Error, ValueError), about=f"{calibration}: ",
                          after="; nothing written"):
                module = calibrated(module, calibration, measured, streaming)
        table = PredictionTable(outputs.table.handle, prediction_columns(module), table_input.columns)
        written = ", ".join(map(str, outputs.paths))
        with _exit_on(OSError, status=1, about=f"cannot write {written}: ", after="; nothing written"), \
                _exit_on((UnicodeDecodeError, csv.Error), about=f"{source}: ", after="; nothing written"):
            stream(module, table_input, streaming, "predict", outputs.writer(table))
            outputs.commit(module)
    log.info("wrote %d rows to %s (%d without prediction)", table.rows_written, target, table.failed)
    for path in outputs.paths[1:]:
        log.info("wrote the embeddings of those rows to %s", path)
    if args.evaluate is not None:
        for name, column, scores in evaluation(args.evaluate, source, target, module):
            log.info("%s against %s: %s", name, column, ", ".join(f"{key} {value:.4g}" for key, value in scores.items()))
            print(json.dumps({"prediction": name, "measured": column, **scores}))
    return 0


def check_files(source: Path, target: Path, ckpts: Sequence[Path], *, calibration: Path | None = None,
                graph: Path | None = None, atoms: Path | None = None, mc_dropout: int | None = None) -> None:
    """A one-line ValueError (IsADirectoryError for a table that is a directory) before any work
    for an input that is not a readable file, an output (the table, the embeddings) that is a
    file the run reads or the other output, embeddings of more than one model."""
    for option, read in (("--input", source), ("--calibrate", calibration)):
        if read is None:
            continue
        problem = unreadable_as_a_file(read)
        if problem:
            raise ValueError(f"{option} {read} {problem}")
        if target.is_dir():
            raise IsADirectoryError(f"--output {target} is a directory")
        what = "input file" if option == "--input" else "calibration file"
        refuse_overwriting_inputs("--output", [target], files_read(read, ckpts, option, what))
    if graph is None and atoms is None:
        return
    if len(ckpts) > 1 or mc_dropout is not None:
        given = f"{len(ckpts)} checkpoints" if len(ckpts) > 1 else f"--mc-dropout {mc_dropout}"
        raise ValueError("--embeddings and --atom-embeddings come from one model: name one --ckpt (a "
                         f"checkpoint, a run directory or pretrained:<name>) without --mc-dropout (got {given})")
    inputs = [*files_read(source, ckpts), ("--calibrate", "calibration file", calibration),
              ("--output", "prediction table", target)]
    paths = {GRAPH_OPTION: graph, ATOM_OPTION: atoms}
    given = [(option, path) for (option, _), path in paths.items() if path is not None]
    for (option, suffix), path in paths.items():
        if path is None:
            continue
        if path.is_dir():
            raise ValueError(f"{option} {path} is a directory; name the file to write")
        if path.suffix.lower() != suffix:
            raise ValueError(f"{option} {path}: the file must end in {suffix} (a NumPy "
                             f"{'array' if suffix == '.npy' else 'archive'})")
        if written_in_place(path):
            raise ValueError(f"{option} {path} is not a regular file")
        others = [(name, "embeddings output", other) for name, other in given if name != option]
        refuse_overwriting_inputs(option, [path], [*inputs, *others])


def files_read(source: Path, ckpts: Sequence[Path], option: str = "--input",
               what: str = "input file") -> list[tuple[str, str, Path]]:
    """``(option, what, path)`` of the input and of each checkpoint, which no output may be
    (:func:`~graphormer_urpe.cli.arguments.refuse_overwriting_inputs`)."""
    return [(option, what, source), *(("--ckpt", "checkpoint", ckpt) for ckpt in ckpts)]


class Outputs:
    """What one run writes: the table (an :class:`~graphormer_urpe.utils.files.AtomicFile`) and
    the :class:`EmbeddingFiles` when named, each checked writable when created (OSError, or
    ValueError naming the option); :meth:`commit` puts them in place together, else none is."""

    def __init__(self, target: Path, graph: Path | None = None, atoms: Path | None = None) -> None:
        #: every path written, the table's first
        self.paths = [target, *(path for path in (graph, atoms) if path is not None)]
        self.table = AtomicFile(target)  # fails now, not after the predictions, if unwritable
        self.embeddings = None
        if graph is not None or atoms is not None:
            try:
                self.embeddings = EmbeddingFiles(graph, atoms)
            except ValueError:
                self.table.discard()
                raise

    def writer(self, table: PredictionTable):
        """What :func:`~graphormer_urpe.prediction.run.stream` hands each chunk to."""
        def write(rows: Sequence[InputRow], output: ChunkOutput) -> None:
            table.write(rows, output.predictions)
            if self.embeddings is not None:
                self.embeddings.write(rows, output)
        return write

    def commit(self, module) -> None:
        """Every output in place together, or none: new vectors never sit beside an old table."""
        commit_together([self.table, *(self.embeddings.assemble(module.width, module.atom_width) if self.embeddings else [])])

    def __enter__(self) -> Outputs:
        return self

    def __exit__(self, *exc_info) -> None:
        if self.embeddings is not None:
            self.embeddings.discard()
        self.table.discard()


class EmbeddingFiles:
    """``--embeddings`` (float32 ``[rows, D]``, NaN for a row without prediction) and
    ``--atom-embeddings`` (``embeddings`` ``[atoms, D]`` and ``offsets`` ``[rows + 1]``); either
    may be None. Each chunk's vectors go to an unnamed temporary file beside the output as they
    come (the system removes it, even after a kill), so memory stays bounded; :meth:`assemble`
    writes the NumPy files from them, for the caller to put in place with the table."""

    def __init__(self, graph: Path | None, atoms: Path | None) -> None:
        self._outputs: dict[str, tuple[AtomicFile, IO[bytes]]] = {}
        self.rows = 0
        self._offsets = array("q", [0])
        try:
            for key, option, path in (("graph", GRAPH_OPTION[0], graph), ("atoms", ATOM_OPTION[0], atoms)):
                if path is None:
                    continue
                try:
                    output = AtomicFile(path, binary=True)
                except OSError as exc:
                    raise ValueError(f"{option} {path} cannot be written ({exc.strerror or exc})") from None
                self._outputs[key] = (output, tempfile.TemporaryFile(dir=Path(os.path.realpath(path)).parent))
        except BaseException:
            self.discard()
            raise

    def write(self, rows: Sequence[InputRow], output: ChunkOutput) -> None:
        self.rows += len(rows)
        if "graph" in self._outputs:
            self._outputs["graph"][1].write(output.embeddings.astype("<f4").tobytes())
        if "atoms" in self._outputs:
            raw, end = self._outputs["atoms"][1], self._offsets[-1]
            for atoms in output.atoms:
                if atoms is not None:
                    raw.write(atoms.astype("<f4").tobytes())
                    end += len(atoms)
                self._offsets.append(end)

    def assemble(self, width: int, atom_width: int) -> list[AtomicFile]:
        """Each file written whole beside its path (``width``: a molecule's vector, ``atom_width``:
        an atom's), for :func:`~graphormer_urpe.utils.files.commit_together` with the table."""
        if "graph" in self._outputs:
            # numpy's header, then the vectors copied through Python's file: np.save of a mapped
            # array hands the file to C's fwrite, whose full disk is no ENOSPC ("N requested and M written")
            output, raw = self._outputs["graph"]
            np.lib.format.write_array_header_1_0(output.handle, {"descr": "<f4", "fortran_order": False,
                                                                 "shape": (self.rows, width)})
            raw.seek(0)
            shutil.copyfileobj(raw, output.handle, 1 << 22)
        if "atoms" in self._outputs:
            output, raw = self._outputs["atoms"]
            offsets = np.frombuffer(self._offsets, dtype=np.int64)
            raw.flush()
            shape = (int(offsets[-1]), atom_width)
            mapped = np.memmap(raw, dtype="<f4", mode="r", shape=shape) if shape[0] * shape[1] else np.zeros(shape, "<f4")
            np.savez(output.handle, embeddings=mapped, offsets=offsets)
        for _, raw in self._outputs.values():
            raw.close()
        return [output for output, _ in self._outputs.values()]

    def discard(self) -> None:
        for output, raw in self._outputs.values():
            raw.close()
            output.discard()


if __name__ == "__main__":
    sys.exit(main())

"""``graphormer-urpe-predict``: predictions for SMILES from a Lightning checkpoint.

    graphormer-urpe-predict --ckpt runs/zinc_urpe/checkpoints/last.ckpt --input mols.csv --output preds.csv

Input: a CSV whose header has a ``smiles`` column (any case), or any other file with one SMILES
a line (UTF-8, a byte-order mark is ignored). Output: one CSV row per input row, in input order:
``row`` (1-based data row), the input's columns (``smiles`` for a one-SMILES-a-line file), one
prediction column per target (``prediction_<target name>`` when the checkpoint records its
targets' names, else ``prediction`` / ``prediction_<k>``) and ``error``. An input column whose
name the output uses gets the prefix ``input_``. A row whose SMILES is empty, rejected by RDKit,
contains white space (RDKit would silently read only its first word), has an atom outside the
featurizer's vocabulary, or is larger than ``--max-nodes`` gets an empty prediction and the
reason; every other row is still predicted.

Safety: the output is written to a temporary file beside it and renamed at the end, so a failure
never leaves a truncated table nor destroys a previous one; an output that is the input file, or
that cannot be written, is refused before any work. A checkpoint is verified before use: zip
CRCs, finite weights, hyperparameters that build this version's model (exit 2 otherwise).

Memory and speed: the input is streamed in chunks of ``--chunk-rows`` rows; ``--workers``
processes featurize them and, on the CPU, predict them with one torch thread each (the model is
loaded without Lightning, :class:`~graphormer_urpe.training.inference.InferenceModel`). Within a
chunk molecules are sorted by size and batched so a batch holds at most ``--max-pairs`` padded
node pairs ``B * (N + 1)^2`` (and ``--batch-size`` molecules), so peak memory is bounded by the
larger of ``--max-pairs`` and ``(max_nodes + 1)^2`` whatever the input's length.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import logging
import multiprocessing
import os
import pickle
import signal
import sys
import tempfile
import zipfile
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from graphormer_urpe.cores import usable_cores

log = logging.getLogger(__name__)

#: Padded node pairs ``B * (N + 1)^2`` per batch (graph token included): ~100 ZINC molecules;
#: larger batches are slower on the CPU (their [B, H, N+1, N+1] tensors leave the caches). The
#: slim model's peak memory grows by ~0.2 KB per pair (README).
DEFAULT_MAX_PAIRS = 1 << 16
#: Bytes per padded pair a predicting process needs for Graphormer-slim (measured, README).
_SLIM_BYTES_PER_PAIR = 200
DEFAULT_BATCH_SIZE = 1024
DEFAULT_MAX_NODES = 512
DEFAULT_CHUNK_ROWS = 1024
#: A molecule every featurizer accepts: a loaded model must predict it (hand-edited checkpoints).
_PROBE_SMILES = "CCO"


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable, damaged or not a graphormer-urpe model."""


@dataclass
class InputRow:
    smiles: str  #: as given (echoed to the output)
    error: str = ""
    fields: list[str] = field(default_factory=list)  #: all columns of a CSV row (empty otherwise)


# ----------------------------------------------------------------------------------- input
@dataclass
class SmilesInput:
    """An opened input: ``columns`` (the CSV header, ``None`` for one SMILES a line) and its rows."""

    path: Path
    columns: list[str] | None
    rows: Iterator[InputRow]


def open_smiles(handle, path: Path) -> SmilesInput:
    """Reads the header of ``handle`` (text, ``newline=""``) and returns its rows lazily."""
    first = handle.readline()
    header = next(csv.reader([first]), [])
    names = [c.strip().lower() for c in header]
    if "smiles" in names:
        column = names.index("smiles")
        return SmilesInput(path, header, _csv_rows(csv.reader(handle), column, len(header)))
    if len(header) > 1:
        raise ValueError(f"{path}: CSV header {header} has no 'smiles' column")

    def lines() -> Iterator[InputRow]:
        if first:
            yield InputRow(first.rstrip("\r\n"))
        for line in handle:
            yield InputRow(line.rstrip("\r\n"))

    return SmilesInput(path, None, lines())


def _csv_rows(reader, column: int, width: int) -> Iterator[InputRow]:
    for fields in reader:
        row = InputRow(fields[column] if column < len(fields) else "", fields=fields)
        if len(fields) != width:
            row.error = f"row has {len(fields)} fields, the header {width}"
            row.fields = (fields + [""] * width)[:width]
        yield row


def _count_lines(path: Path) -> int:
    """Newlines in ``path`` (the progress bar's total; a quick binary pass)."""
    count = 0
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            count += block.count(b"\n")
    return count


# --------------------------------------------------------------------------------- output
class PredictionTable:
    """Writes prediction rows to a CSV handle: ``row``, the input's columns (``smiles`` when
    ``columns`` is None), the ``predictions`` columns (:func:`prediction_columns`), ``error``;
    ``\\n`` line endings."""

    def __init__(self, handle, predictions: Sequence[str], columns: Sequence[str] | None = None) -> None:
        predictions = list(predictions)
        taken = {"row", "error", *predictions}
        inputs = []
        for name in (["smiles"] if columns is None else columns):
            while name in taken:
                name = f"input_{name}"
            taken.add(name)
            inputs.append(name)
        self._echo_fields = columns is not None
        self._writer = csv.writer(handle, lineterminator="\n")
        self._writer.writerow(["row", *inputs, *predictions, "error"])
        self.rows_written = 0
        self.failed = 0

    def write(self, rows: Sequence[InputRow], predictions: np.ndarray) -> None:
        for row, pred in zip(rows, predictions):
            self.rows_written += 1
            self.failed += bool(row.error)
            values = ["" if row.error else f"{v:.6g}" for v in pred]
            echoed = row.fields if self._echo_fields else [row.smiles]
            self._writer.writerow([self.rows_written, *echoed, *values, row.error])


class AtomicOutput:
    """A text file written beside ``path`` and renamed onto it by :meth:`commit`; dropped on
    :meth:`discard` (or leaving the ``with`` block without a commit). Creating it checks that
    ``path`` can be written."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if self.path.is_dir():
            raise IsADirectoryError(f"--output {self.path} is a directory")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, self._temporary = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.",
                                               suffix=".part")
        self.handle = open(fd, "w", newline="", encoding="utf-8")

    def commit(self) -> None:
        self.handle.flush()
        os.fsync(self.handle.fileno())
        self.handle.close()
        umask = os.umask(0)
        os.umask(umask)
        mode = self.path.stat().st_mode & 0o777 if self.path.exists() else 0o666 & ~umask
        os.chmod(self._temporary, mode)
        os.replace(self._temporary, self.path)

    def discard(self) -> None:
        self.handle.close()
        if os.path.exists(self._temporary):
            os.unlink(self._temporary)

    def __enter__(self) -> AtomicOutput:
        return self

    def __exit__(self, *exc_info) -> None:
        self.discard()


def write_predictions(path: str | Path, rows: Sequence[InputRow], predictions: np.ndarray,
                      prediction_names: Sequence[str], columns: Sequence[str] | None = None) -> None:
    """Writes the prediction table (:class:`PredictionTable`) of ``rows`` and ``predictions
    [len(rows), T]`` (columns ``prediction_names``) to ``path`` atomically (a temporary file
    beside it, renamed at the end)."""
    with AtomicOutput(path) as output:
        PredictionTable(output.handle, prediction_names, columns).write(rows, predictions)
        output.commit()


# ----------------------------------------------------------------------------- checkpoint
def _verify_archive(ckpt: Path) -> None:
    import zlib

    if not zipfile.is_zipfile(ckpt):
        raise CheckpointError(f"checkpoint {ckpt} cannot be read: not a PyTorch checkpoint archive "
                              "(truncated, damaged or another kind of file)")
    try:
        with zipfile.ZipFile(ckpt) as archive:
            damaged = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, zlib.error) as exc:
        raise CheckpointError(f"checkpoint {ckpt} cannot be read: damaged archive ({exc})") from None
    if damaged is not None:
        raise CheckpointError(f"checkpoint {ckpt} is damaged: its entry {damaged} fails the CRC check")


def _check_finite(ckpt: Path, state_dict: dict) -> None:
    bad = [name for name, value in state_dict.items()
           if isinstance(value, torch.Tensor) and value.is_floating_point() and not torch.isfinite(value).all()]
    if bad:
        raise CheckpointError(f"checkpoint {ckpt} has non-finite weights (NaN or inf) in {len(bad)} "
                              f"tensor(s): {', '.join(bad[:5])}")


def load_module(ckpt: str | Path, map_location: str = "cpu", *, inference_only: bool = False):
    """The verified :class:`GraphormerModule` stored in a Lightning checkpoint, in eval mode;
    with ``inference_only`` its :class:`~graphormer_urpe.training.inference.InferenceModel`
    instead (same ``model``, ``hparams`` and ``predict_step``; Lightning is not imported).

    Raises :class:`CheckpointError` for a missing file, a damaged archive (zip CRCs), content
    that is not plain data, non-finite weights, and hyperparameters or weights that do not build
    this version's model.
    """
    from graphormer_urpe.data.features import num_embeddings
    from graphormer_urpe.data.featurize import featurizer_spec
    from graphormer_urpe.training.task import get_task

    if inference_only:
        from graphormer_urpe.training.inference import InferenceModel as model_class
    else:
        from graphormer_urpe.training.module import GraphormerModule as model_class

    ckpt = Path(ckpt)
    if not ckpt.is_file():
        raise CheckpointError(f"checkpoint {ckpt} does not exist")
    _verify_archive(ckpt)
    try:
        # weights_only: a checkpoint is data, never code to run (our hparams are plain values).
        checkpoint = torch.load(ckpt, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError:
        raise CheckpointError(f"checkpoint {ckpt} cannot be read: it holds objects other than "
                              "tensors and plain values, which are never loaded") from None
    except Exception as exc:  # noqa: BLE001 - any failure of a verified archive is a bad file
        reason = str(exc).splitlines()[0] if str(exc) else ""
        raise CheckpointError(f"checkpoint {ckpt} cannot be read ({type(exc).__name__}: {reason})") from None
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict) \
            or not isinstance(checkpoint.get("hyper_parameters"), dict):
        raise CheckpointError(f"{ckpt} is not a Lightning checkpoint (no state_dict/hyper_parameters)")
    _check_finite(ckpt, checkpoint["state_dict"])
    hparams = dict(checkpoint["hyper_parameters"])
    hparams.pop("_instantiator", None)
    hparams.pop("_class_path", None)
    hparams["compile"] = False  # inference needs no compile warm-up, whatever training used
    hparams["init_from"] = None  # its weights are in this checkpoint; the file may be gone
    try:
        spec = featurizer_spec(hparams.get("featurizer", "zinc"))
        get_task(hparams.get("task", "regression"))
        for kind, dims in (("atom", spec.atom_feature_dims), ("bond", spec.bond_feature_dims)):
            if hparams.get(f"num_{kind}_embeddings") != num_embeddings(dims):
                raise ValueError(f"num_{kind}_embeddings={hparams.get(f'num_{kind}_embeddings')!r} but "
                                 f"featurizer {spec.name!r} needs {num_embeddings(dims)}")
        module = model_class(**hparams)
        module.load_state_dict(checkpoint["state_dict"])
        module.eval()
        predict_smiles(module, [InputRow(_PROBE_SMILES)], max_nodes=8, batch_size=1)
    except Exception as exc:  # noqa: BLE001 - hand-edited hyperparameters fail in many ways
        raise CheckpointError(f"checkpoint {ckpt} does not match this version's GraphormerModule "
                              f"({type(exc).__name__}: {exc})") from None
    return module


def prediction_columns(module) -> list[str]:
    """The prediction columns of a loaded model: its task's
    (:meth:`~graphormer_urpe.training.task.Task.prediction_columns`), named after the targets
    when the checkpoint records them."""
    from graphormer_urpe.training.task import get_task

    hparams = module.hparams
    names = hparams.get("target_names")
    return get_task(hparams.get("task", "regression")).prediction_columns(
        hparams.num_targets, list(names) if names is not None else None)


# ---------------------------------------------------------------------------- prediction
@dataclass
class RawChunk:
    """A chunk's accepted molecules, sorted by atom count, as flat raw feature arrays.

    ``position [G]`` (row within the chunk), ``x [sum n, F]``, ``node_ptr [G + 1]``,
    ``edge_index [2, sum E]`` (local ids), ``edge_attr [sum E, Fe]``, ``edge_ptr [G + 1]``;
    ``errors``: ``(row within chunk, reason)`` of the rejected rows.
    """

    position: np.ndarray
    x: np.ndarray
    node_ptr: np.ndarray
    edge_index: np.ndarray
    edge_attr: np.ndarray
    edge_ptr: np.ndarray
    errors: list[tuple[int, str]]


def featurize_chunk(job: tuple[str, int, list[str]]) -> RawChunk:
    """``(featurizer, max_nodes, smiles)`` -> :class:`RawChunk` (runs in worker processes)."""
    from rdkit import RDLogger

    from graphormer_urpe.data.featurize import featurizer_spec

    RDLogger.DisableLog("rdApp.*")  # reasons go into the output's error column instead
    name, max_nodes, smiles = job
    spec = featurizer_spec(name)
    graphs, errors = [], []
    for position, text in enumerate(smiles):
        if not text.strip():
            errors.append((position, "empty SMILES"))
            continue
        try:
            x, edge_index, edge_attr = spec.graph_arrays(text)
        except ValueError as exc:
            errors.append((position, str(exc)))
            continue
        if len(x) > max_nodes:
            errors.append((position, f"molecule has {len(x)} atoms, more than max_nodes={max_nodes}"))
            continue
        graphs.append((len(x), position, x, edge_index, edge_attr))
    graphs.sort(key=lambda g: g[0])  # stable: equal sizes keep input order
    n = np.array([g[0] for g in graphs], dtype=np.int64)
    e = np.array([g[3].shape[1] for g in graphs], dtype=np.int64)
    return RawChunk(
        position=np.array([g[1] for g in graphs], dtype=np.int64),
        x=np.concatenate([g[2] for g in graphs]) if graphs else np.zeros((0, len(spec.atom_feature_dims))),
        node_ptr=np.concatenate([[0], np.cumsum(n)]),
        edge_index=np.concatenate([g[3] for g in graphs], axis=1) if graphs else np.zeros((2, 0), np.int64),
        edge_attr=np.concatenate([g[4] for g in graphs]) if graphs else np.zeros((0, len(spec.bond_feature_dims))),
        edge_ptr=np.concatenate([[0], np.cumsum(e)]),
        errors=errors,
    )


def size_batches(num_nodes: np.ndarray, max_pairs: int, batch_size: int) -> Iterator[tuple[int, int]]:
    """``[start, end)`` ranges over graphs sorted by ``num_nodes`` (ascending) such that
    ``(end - start) * (num_nodes[end - 1] + 1)^2 <= max_pairs`` (or one graph alone) and at most
    ``batch_size`` graphs."""
    start = 0
    while start < len(num_nodes):
        end = start + 1
        while (end < len(num_nodes) and end - start < batch_size
               and (end + 1 - start) * (int(num_nodes[end]) + 1) ** 2 <= max_pairs):
            end += 1
        yield start, end
        start = end


def predict_chunk(module, chunk: RawChunk, num_rows: int, max_pairs: int, batch_size: int) -> np.ndarray:
    """``[num_rows, T]`` predictions of one featurized chunk (NaN for its rejected rows)."""
    from graphormer_urpe.data.collate import collate
    from graphormer_urpe.data.encode import encode_flat
    from graphormer_urpe.data.encoding_registry import EncodingParams
    from graphormer_urpe.data.featurize import featurizer_spec

    hp = module.hparams
    spec = featurizer_spec(hp.featurizer)
    out = np.full((num_rows, hp.num_targets), np.nan, dtype=np.float32)
    device = next(module.parameters()).device
    node_ptr, edge_ptr = chunk.node_ptr, chunk.edge_ptr
    params = EncodingParams.of_model(hp.max_hops, hp.get("node_encodings"))
    with torch.inference_mode():
        for g0, g1 in size_batches(np.diff(node_ptr), max_pairs, batch_size):
            n0, n1, e0, e1 = node_ptr[g0], node_ptr[g1], edge_ptr[g0], edge_ptr[g1]
            flat = encode_flat(chunk.x[n0:n1], node_ptr[g0:g1 + 1] - n0, chunk.edge_index[:, e0:e1],
                               chunk.edge_attr[e0:e1], edge_ptr[g0:g1 + 1] - e0,
                               np.full((g1 - g0, 1), np.nan, np.float32), params=params,
                               atom_feature_dims=spec.atom_feature_dims,
                               bond_feature_dims=spec.bond_feature_dims)
            batch = collate(flat, np.arange(g1 - g0))
            out[chunk.position[g0:g1]] = module.predict_step(batch.to(device), 0)["prediction"].cpu().numpy()
    return out


def _finish_rows(rows: list[InputRow], errors: list[tuple[int, str]], predictions: np.ndarray) -> None:
    for position, reason in errors:
        rows[position].error = rows[position].error or reason
    for position in np.flatnonzero(~np.isfinite(predictions).all(axis=1)):
        rows[position].error = rows[position].error or "prediction is not finite"


def predict_smiles(module, rows: list[InputRow], max_nodes: int = DEFAULT_MAX_NODES,
                   max_pairs: int = DEFAULT_MAX_PAIRS,
                   batch_size: int = DEFAULT_BATCH_SIZE) -> np.ndarray:
    """``[len(rows), num_targets]`` predictions in this process; NaN (with ``row.error`` set)
    where impossible."""
    chunk = featurize_chunk((module.hparams.featurizer, max_nodes, [r.smiles for r in rows]))
    predictions = predict_chunk(module, chunk, len(rows), max_pairs, batch_size)
    _finish_rows(rows, chunk.errors, predictions)
    return predictions


def _chunks(rows: Iterable[InputRow], size: int) -> Iterator[list[InputRow]]:
    chunk = []
    for row in rows:
        chunk.append(row)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


#: The model a worker process predicts with (``None``: the worker only featurizes).
_worker_module = None


def _init_worker(module) -> None:
    global _worker_module
    for signum in STOP_SIGNALS:  # the parent stops its pool; a worker just ends
        signal.signal(signum, signal.SIG_DFL)
    # One torch thread per process: processes scale over cores without OpenMP teams contending
    # (and a team in a forked child of a multi-threaded parent would deadlock in libgomp).
    torch.set_num_threads(1)
    _worker_module = module


def _chunk_job(job: tuple[str, int, int, int, list[str]]) -> tuple[RawChunk | np.ndarray, list[tuple[int, str]]]:
    """In a worker: ``(featurizer, max_nodes, max_pairs, batch_size, smiles)`` -> (predictions
    ``[rows, T]`` when the worker holds the model, else the featurized chunk; the row errors)."""
    featurizer, max_nodes, max_pairs, batch_size, smiles = job
    chunk = featurize_chunk((featurizer, max_nodes, smiles))
    if _worker_module is None:
        return chunk, chunk.errors
    return predict_chunk(_worker_module, chunk, len(smiles), max_pairs, batch_size), chunk.errors


def stream_predictions(module, rows: Iterable[InputRow], table: PredictionTable, *, max_nodes: int,
                       max_pairs: int, batch_size: int, chunk_rows: int, workers: int, progress=None) -> None:
    """Predicts ``rows`` chunk by chunk and writes each chunk in input order.

    ``workers = 0``: everything in this process. Otherwise ``workers`` forked processes
    featurize the chunks and, when the model is on the CPU, also predict them with one torch
    thread each (on an accelerator this process predicts). At most ``2 * workers + 1`` chunks
    are in memory.
    """
    settings = (module.hparams.featurizer, max_nodes, max_pairs, batch_size)

    def finish(chunk: list[InputRow], result: RawChunk | np.ndarray, errors: list[tuple[int, str]]) -> None:
        predictions = (predict_chunk(module, result, len(chunk), max_pairs, batch_size)
                       if isinstance(result, RawChunk) else result)
        _finish_rows(chunk, errors, predictions)
        table.write(chunk, predictions)
        if progress is not None:
            progress.update(len(chunk))

    if workers == 0:
        for chunk in _chunks(rows, chunk_rows):
            featurized = featurize_chunk((settings[0], max_nodes, [r.smiles for r in chunk]))
            finish(chunk, featurized, featurized.errors)
        return
    on_cpu = next(module.parameters()).device.type == "cpu"
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    with multiprocessing.get_context(method).Pool(workers, _init_worker, (module if on_cpu else None,)) as pool:
        pending: deque = deque()
        for chunk in _chunks(rows, chunk_rows):
            pending.append((chunk, pool.apply_async(_chunk_job, ((*settings, [r.smiles for r in chunk]),))))
            if len(pending) > 2 * workers:
                chunk, result = pending.popleft()
                finish(chunk, *result.get())
        while pending:
            chunk, result = pending.popleft()
            finish(chunk, *result.get())


# ---------------------------------------------------------------------------------- CLI
#: Signals that stop the command like Ctrl-C: ``kill``, a closed terminal or SSH session.
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within the block, :data:`STOP_SIGNALS` raise ``SystemExit(128 + signal)`` in the main
    thread, so ``finally`` blocks and ``with`` exits run (the temporary output file is removed)
    instead of the process dying on the spot; the previous handlers are restored on exit."""
    def stop(signum, frame):
        raise SystemExit(128 + signum)

    previous = {signum: signal.signal(signum, stop) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


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
    parser.add_argument("--ckpt", required=True, help="Lightning checkpoint (.ckpt) of any config")
    parser.add_argument("--input", required=True,
                        help="CSV with a 'smiles' column (other columns are kept), or one SMILES a line")
    parser.add_argument("--output", required=True, help="CSV to write (never the input)")
    parser.add_argument("--max-nodes", type=_positive_int, default=DEFAULT_MAX_NODES,
                        help="larger molecules get an error row instead of a prediction (default "
                             f"{DEFAULT_MAX_NODES})")
    parser.add_argument("--max-pairs", type=_positive_int, default=DEFAULT_MAX_PAIRS,
                        help="padded node pairs B*(N+1)^2 per batch: bounds peak memory "
                             f"(default {DEFAULT_MAX_PAIRS})")
    parser.add_argument("--batch-size", type=_positive_int, default=DEFAULT_BATCH_SIZE,
                        help=f"most molecules per batch (default {DEFAULT_BATCH_SIZE})")
    parser.add_argument("--workers", type=_non_negative_int, default=usable_cores(),
                        help="processes that featurize and, on the CPU, predict with one torch thread "
                             "each; 0 = all in this process with torch's threads (default: the CPU "
                             "cores available)")
    parser.add_argument("--chunk-rows", type=_positive_int, default=DEFAULT_CHUNK_ROWS,
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


def _check_paths(source: Path, target: Path) -> None:
    if not source.is_file():
        raise FileNotFoundError(f"input file {source} does not exist")
    if target.exists() and os.path.samefile(source, target):
        raise ValueError(f"--output {target} is the input file {source}: it would be overwritten; "
                         "choose another output")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with stop_on_signals():  # before the temporary output exists
        return _predict(args)


def _predict(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    source, target = Path(args.input), Path(args.output)
    try:
        device = _check_device(args.device)
        _check_paths(source, target)
        output = AtomicOutput(target)  # fails now, not after the predictions, if unwritable
    except (FileNotFoundError, ValueError, OSError) as exc:
        print(f"graphormer-urpe-predict: error: {exc}", file=sys.stderr)
        return 2
    with output, open(source, newline="", encoding="utf-8-sig") as handle:
        try:
            module = load_module(args.ckpt, inference_only=True).to(device)
            table_input = open_smiles(handle, source)
        except (CheckpointError, ValueError, UnicodeDecodeError) as exc:
            print(f"graphormer-urpe-predict: error: {exc}", file=sys.stderr)
            return 2
        from tqdm import tqdm

        table = PredictionTable(output.handle, prediction_columns(module), table_input.columns)
        total = _count_lines(source) - (table_input.columns is not None)
        with tqdm(total=max(total, 0), unit="mol", disable=args.quiet, file=sys.stderr,
                  mininterval=1.0, desc="predict") as progress:
            try:
                stream_predictions(module, table_input.rows, table, max_nodes=args.max_nodes,
                                   max_pairs=args.max_pairs, batch_size=args.batch_size,
                                   chunk_rows=args.chunk_rows, workers=args.workers, progress=progress)
            except (UnicodeDecodeError, csv.Error) as exc:
                print(f"graphormer-urpe-predict: error: {source}: {exc}; nothing written",
                      file=sys.stderr)
                return 2
            except OSError as exc:  # e.g. disk full: the previous output stays as it was
                print(f"graphormer-urpe-predict: error: cannot write {target}: {exc}; nothing written",
                      file=sys.stderr)
                return 1
        output.commit()
    log.info("wrote %d rows to %s (%d without prediction)", table.rows_written, target, table.failed)
    return 0


if __name__ == "__main__":
    sys.exit(main())

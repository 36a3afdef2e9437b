"""A SMILES file predicted with one or several checkpoints, as ``graphormer-urpe-predict`` does it.

- :func:`check_files`: what a run reads and writes, checked before any work: the input and a
  calibration file are readable files, no output is a file the run reads (the input, the
  calibration file, a checkpoint: however spelled, a symbolic or hard link too), embeddings
  come from one model and have their own paths.
- :func:`prediction_model`: the model to predict with: one checkpoint's, the mean and spread of
  several (:class:`~graphormer_urpe.prediction.model.ModelEnsemble`), one checkpoint's Monte
  Carlo dropout (:class:`~graphormer_urpe.prediction.model.MCDropout`), with its embeddings
  (:class:`~graphormer_urpe.prediction.model.WithEmbeddings`), on a device; :func:`predicting`
  makes the same of a model already loaded (the Python API's).
- :class:`Outputs`: the prediction table and the embeddings files, each written beside its
  path and put in place together at the end: all of them or, on any failure, none (a previous
  file stays as it was).
- :func:`stream`: an input's rows (a file's, or a list's) predicted into the table (and the
  embeddings), with a progress bar.

Memory and speed: the input is streamed in chunks of ``chunk_rows`` rows; ``workers`` processes
featurize them and, on the CPU, predict them with one torch thread each (the model is loaded
without Lightning, :class:`~graphormer_urpe.prediction.model.PredictionModel`). Within a chunk
molecules are sorted by size and batched so a batch holds at most ``max_pairs`` padded node pairs
``B * (N + 1)^2`` (and ``batch_size`` molecules), so peak memory is bounded by the larger of
``max_pairs`` and ``(max_nodes + 1)^2`` whatever the input's length.
"""
from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from graphormer_urpe.prediction.embeddings import (
    ATOM_OPTION, GRAPH_OPTION, EmbeddingArrays, EmbeddingFiles, check_embedding_paths)
from graphormer_urpe.prediction.load import files_read, load_models
from graphormer_urpe.prediction.model import (
    DEFAULT_BATCH_SIZE, DEFAULT_MAX_NODES, DEFAULT_MAX_PAIRS, MCDropout, WithEmbeddings, stream_predictions)
from graphormer_urpe.prediction.table import PredictionArrays, PredictionTable, SmilesInput
from graphormer_urpe.utils.files import AtomicFile, commit_together, refuse_overwriting_inputs, unreadable_as_a_file

DEFAULT_CHUNK_ROWS = 1024
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


@dataclass(frozen=True)
class Streaming:
    """How rows are predicted (:func:`~graphormer_urpe.prediction.model.stream_predictions`), and
    whether a progress bar is drawn on stderr."""

    max_nodes: int = DEFAULT_MAX_NODES
    max_pairs: int = DEFAULT_MAX_PAIRS
    batch_size: int = DEFAULT_BATCH_SIZE
    chunk_rows: int = DEFAULT_CHUNK_ROWS
    workers: int = 0
    quiet: bool = False


def check_device(name: str) -> torch.device:
    """The torch device ``name`` (``--device``), or a one-line ValueError: not a device, CUDA
    not available here, no such CUDA device."""
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


def check_files(source: Path, target: Path, ckpts: Sequence[Path], *, calibration: Path | None = None,
                graph: Path | None = None, atoms: Path | None = None, mc_dropout: int | None = None) -> None:
    """A one-line ValueError (IsADirectoryError for a table that is a directory) before any work
    for what a run with these files cannot do: an input (``source``, ``calibration``) that is
    not a readable file, an output (the table ``target``, the embeddings ``graph`` and
    ``atoms``) that is one of the files the run reads, embeddings of more than one model."""
    for option, read in (("--input", source), ("--calibrate", calibration)):
        if read is not None:
            _check_input(option, read, target, ckpts)
    if graph is not None or atoms is not None:
        check_one_model(ckpts, mc_dropout)
        check_embedding_paths({GRAPH_OPTION: graph, ATOM_OPTION: atoms}, [
            *files_read(source, ckpts), ("--calibrate", "calibration file", calibration),
            ("--output", "prediction table", target)])


def _check_input(option: str, read: Path, target: Path, ckpts: Sequence[Path]) -> None:
    """The file ``option`` names (the input, the calibration file) can be read, and the output is
    never a file the command reads: it or a checkpoint (any spelling, symbolic or hard link)."""
    problem = unreadable_as_a_file(read)
    if problem:
        raise ValueError(f"{option} {read} {problem}")
    if target.is_dir():
        raise IsADirectoryError(f"--output {target} is a directory")
    what = "input file" if option == "--input" else "calibration file"
    refuse_overwriting_inputs("--output", [target], files_read(read, ckpts, option, what))


def check_one_model(ckpts: Sequence[Path], mc_dropout: int | None) -> None:
    """Embeddings are one model's vectors: one checkpoint, no MC dropout (one line otherwise)."""
    if len(ckpts) > 1 or mc_dropout is not None:
        given = f"{len(ckpts)} checkpoints" if len(ckpts) > 1 else f"--mc-dropout {mc_dropout}"
        raise ValueError("--embeddings and --atom-embeddings come from one model: name one --ckpt (a "
                         f"checkpoint, a run directory or pretrained:<name>) without --mc-dropout (got {given})")


def default_device() -> str:
    """The device a prediction runs on unless told: ``cuda`` where torch sees one, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_mc_dropout(models: int, mc_dropout: int | None) -> None:
    """MC dropout samples one model (ValueError for ``models`` > 1)."""
    if mc_dropout is not None and models > 1:
        raise ValueError("--mc-dropout takes one checkpoint (several checkpoints already give a std)")


def prediction_model(ckpts: Sequence[Path], device: torch.device, *, mc_dropout: int | None = None,
                     seed: int = 0, max_pairs: int = DEFAULT_MAX_PAIRS, embeddings: bool = False,
                     atoms: bool = False):
    """The verified model of ``ckpts`` (:func:`~graphormer_urpe.prediction.load.load_models`:
    several are their mean, with a std) as :func:`predicting` makes it predict.
    :class:`~graphormer_urpe.utils.torch_files.CheckpointError` for a checkpoint that does not
    load; ValueError for MC dropout over several checkpoints (before any is read)."""
    check_mc_dropout(len(ckpts), mc_dropout)
    return predicting(load_models(ckpts), device, mc_dropout=mc_dropout, seed=seed, max_pairs=max_pairs,
                      embeddings=embeddings, atoms=atoms)


def predicting(module, device: torch.device, *, mc_dropout: int | None = None, seed: int = 0,
               max_pairs: int = DEFAULT_MAX_PAIRS, embeddings: bool = False, atoms: bool = False):
    """A loaded model (one, or a :class:`~graphormer_urpe.prediction.model.ModelEnsemble`) on
    ``device`` as it predicts: with ``embeddings`` it also gives its graph-token vectors (and
    with ``atoms`` each atom's), with ``mc_dropout`` it predicts that many times with dropout
    on (masks from ``seed``). ValueError for MC dropout over several models, a model without
    dropout, embeddings of several models."""
    check_mc_dropout(len(getattr(module, "members", [module])), mc_dropout)
    if embeddings:
        module = WithEmbeddings(module, atoms=atoms)
    if mc_dropout is not None:
        module = MCDropout(module, mc_dropout, seed, max_pairs)
    return module.to(device)


class Outputs:
    """What one run writes: the prediction table at ``target`` (``table``, an
    :class:`~graphormer_urpe.utils.files.AtomicFile`) and the embeddings ``graph`` (``.npy``)
    and ``atoms`` (``.npz``) when named (``embeddings``, an
    :class:`~graphormer_urpe.prediction.embeddings.EmbeddingFiles`). Creating it checks that
    each can be written (OSError, or ValueError naming the option); :meth:`commit` puts them all
    in place together; leaving the ``with`` block otherwise writes none."""

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

    def commit(self, module) -> None:
        """Every output in place together, or none: new vectors never sit beside an old table
        (``module``: the :class:`~graphormer_urpe.prediction.model.WithEmbeddings` that gave them)."""
        commit_together([self.table, *(self.embeddings.assemble(module.width, module.atom_width) if self.embeddings else [])])

    def __enter__(self) -> Outputs:
        return self

    def __exit__(self, *exc_info) -> None:
        if self.embeddings is not None:
            self.embeddings.discard()
        self.table.discard()


def stream(module, table_input: SmilesInput, table: PredictionTable | PredictionArrays, streaming: Streaming,
           desc: str, embeddings: EmbeddingFiles | EmbeddingArrays | None = None) -> None:
    """Predict every row of ``table_input`` into ``table`` (and ``embeddings``), with a progress
    bar named ``desc`` unless ``streaming.quiet``: what ``graphormer-urpe-predict`` writes to its
    files and the Python API keeps in memory (``table``: a
    :class:`~graphormer_urpe.prediction.table.PredictionTable` or
    :class:`~graphormer_urpe.prediction.table.PredictionArrays`)."""
    from tqdm import tqdm

    with tqdm(total=table_input.count(), unit="mol", disable=streaming.quiet, file=sys.stderr,
              mininterval=1.0, desc=desc) as progress:
        stream_predictions(module, table_input.rows, table, max_nodes=streaming.max_nodes,
                           max_pairs=streaming.max_pairs, batch_size=streaming.batch_size,
                           chunk_rows=streaming.chunk_rows, workers=streaming.workers, progress=progress,
                           embeddings=embeddings)

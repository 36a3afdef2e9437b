"""An input's rows predicted chunk by chunk, as ``graphormer-urpe-predict`` and the Python API
predict them: :func:`predicting` wraps a loaded model for what it is asked (embeddings, MC
dropout), :func:`stream` predicts every row with it and hands each chunk, in input order, to a
writer. ``workers`` processes featurize the chunks (and, on the CPU, predict them, one torch
thread each); at most ``2 * workers + 1`` chunks are in memory and a batch holds at most
``max(max_pairs, (max_nodes + 1)^2)`` padded node pairs, whatever the input's length.
"""
from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from graphormer_urpe.data.facts import DataFacts
from graphormer_urpe.data.featurize import FeaturizedChunk
from graphormer_urpe.prediction.model import (
    DEFAULT_BATCH_SIZE, DEFAULT_MAX_NODES, DEFAULT_MAX_PAIRS, ChunkOutput, MCDropout, WithEmbeddings,
    featurize_rows, finish_rows, predict_chunk)
from graphormer_urpe.prediction.table import InputRow, SmilesInput
from graphormer_urpe.utils.workers import WorkerProcesses, useful_workers

DEFAULT_CHUNK_ROWS = 1024


@dataclass(frozen=True)
class Streaming:
    """How rows are predicted (:func:`stream`), and whether a progress bar is drawn on stderr."""

    max_nodes: int = DEFAULT_MAX_NODES
    max_pairs: int = DEFAULT_MAX_PAIRS
    batch_size: int = DEFAULT_BATCH_SIZE
    chunk_rows: int = DEFAULT_CHUNK_ROWS
    workers: int = 0
    quiet: bool = False


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(name: str) -> torch.device:
    """The torch device ``name`` (``--device``), or a one-line ValueError."""
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


def check_mc_dropout(models: int, mc_dropout: int | None) -> None:
    """MC dropout samples one model (ValueError for ``models`` > 1)."""
    if mc_dropout is not None and models > 1:
        raise ValueError("--mc-dropout takes one checkpoint (several checkpoints already give a std)")


def predicting(module, device: torch.device, *, mc_dropout: int | None = None, seed: int = 0,
               max_pairs: int = DEFAULT_MAX_PAIRS, embeddings: bool = False, atoms: bool = False):
    """A loaded model on ``device`` as it predicts: with its ``embeddings`` (and ``atoms``'), or
    ``mc_dropout`` times with dropout on (masks from ``seed``); ValueError where it cannot."""
    check_mc_dropout(len(getattr(module, "members", [module])), mc_dropout)
    if embeddings:
        module = WithEmbeddings(module, atoms=atoms)
    if mc_dropout is not None:
        module = MCDropout(module, mc_dropout, seed, max_pairs)
    return module.to(device)


def stream(module, table_input: SmilesInput, streaming: Streaming, desc: str,
           write: Callable[[list[InputRow], ChunkOutput], object]) -> None:
    """Predict every row of ``table_input`` with ``module`` and hand each chunk, in input order,
    to ``write(rows, output)`` (a row without a prediction has its reason in ``row.error``); a
    progress bar named ``desc`` unless ``streaming.quiet``; ``streaming.workers`` 0: all in this
    process."""
    from tqdm import tqdm

    max_pairs, batch_size = streaming.max_pairs, streaming.batch_size

    def finish(chunk: list[InputRow], result: FeaturizedChunk | ChunkOutput, errors: list[tuple[int, str]]) -> None:
        output = (predict_chunk(module, result, len(chunk), max_pairs, batch_size)
                  if isinstance(result, FeaturizedChunk) else result)
        finish_rows(chunk, errors, output)
        write(chunk, output)
        progress.update(len(chunk))

    with tqdm(total=table_input.count(), unit="mol", disable=streaming.quiet, file=sys.stderr,
              mininterval=1.0, desc=desc) as progress:
        rows = iter(table_input.rows)
        chunks = iter(lambda: list(itertools.islice(rows, streaming.chunk_rows)), [])
        if streaming.workers == 0:
            for chunk in chunks:
                featurized = featurize_rows(module.facts, [r.smiles for r in chunk], streaming.max_nodes)
                finish(chunk, featurized, featurized.errors)
            return
        on_cpu = next(module.parameters()).device.type == "cpu"
        first = list(itertools.islice(chunks, useful_workers(streaming.workers)))  # one worker each, at most
        if not first:
            return
        jobs = ((chunk, (streaming.max_nodes, max_pairs, batch_size, [r.smiles for r in chunk]))
                for chunk in itertools.chain(first, chunks))
        with WorkerProcesses(len(first), _chunk_job, _init_worker, (module.facts, module if on_cpu else None)) as pool:
            for chunk, (result, errors) in pool.imap(jobs, ahead=2 * pool.workers + 1):
                finish(chunk, result, errors)


#: The facts of the model, and the model a worker process predicts with (``None``: the worker
#: only featurizes).
_worker_facts, _worker_module = None, None


def _init_worker(facts: DataFacts, module) -> None:
    global _worker_facts, _worker_module
    # One torch thread per process: processes scale over cores without OpenMP teams contending
    # (and a team in a forked child of a multi-threaded parent would deadlock in libgomp).
    torch.set_num_threads(1)
    _worker_facts, _worker_module = facts, module


def _chunk_job(job: tuple[int, int, int, list[str]]) -> tuple[FeaturizedChunk | ChunkOutput, list[tuple[int, str]]]:
    """In a worker: the chunk predicted where the worker holds the model, else featurized; its errors."""
    max_nodes, max_pairs, batch_size, smiles = job
    chunk = featurize_rows(_worker_facts, smiles, max_nodes)
    if _worker_module is None:
        return chunk, chunk.errors
    return predict_chunk(_worker_module, chunk, len(smiles), max_pairs, batch_size), chunk.errors

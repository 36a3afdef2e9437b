"""A trained model for prediction only: a checkpoint's backbone and output transform, no Lightning.

:class:`PredictionModel` builds the backbone as
:class:`~graphormer_urpe.training.module.GraphormerModule` does
(:func:`~graphormer_urpe.nn.graphormer.build_backbone`) and loads a Lightning checkpoint's
``state_dict`` and ``hyper_parameters`` as they are, without importing Lightning (several seconds
of every start), so both give the same predictions from the same weights.

Prediction of many SMILES (:func:`stream_predictions`): the input is taken in chunks, whose
molecules are featurized, sorted by size and batched so a batch holds at most ``max_pairs``
padded node pairs ``B * (N + 1)^2`` (and ``batch_size`` molecules): peak memory is bounded by the
larger of ``max_pairs`` and ``(max_nodes + 1)^2`` whatever the input's length. Worker processes
featurize the chunks and, on the CPU, predict them with one torch thread each.
"""
from __future__ import annotations

import contextlib
import itertools
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from graphormer_urpe.data.batch import GraphBatch
from graphormer_urpe.data.facts import DataFacts
from graphormer_urpe.nn.graphormer import GraphormerConfig, build_backbone
from graphormer_urpe.data.task import get_task
from graphormer_urpe.prediction.table import InputRow, PredictionTable, prediction_columns
from graphormer_urpe.utils.workers import WorkerProcesses, useful_workers

#: Padded node pairs ``B * (N + 1)^2`` per batch (graph token included): ~100 ZINC molecules;
#: larger batches are slower on the CPU (their [B, H, N+1, N+1] tensors leave the caches). The
#: slim model's peak memory grows by ~0.2 KB per pair (README).
DEFAULT_MAX_PAIRS = 1 << 16
DEFAULT_BATCH_SIZE = 1024
DEFAULT_MAX_NODES = 512

#: Hyperparameters of ``GraphormerModule`` that only training uses: its arguments other than
#: PredictionModel's (a test keeps them so; importing the module here would import Lightning).
TRAINING_HPARAMS = frozenset({"lr", "end_lr", "warmup_steps", "total_steps", "power", "weight_decay",
                              "betas", "eps", "no_weight_decay", "compile",
                              "matmul_precision", "init_from", "reinit_head", "freeze_backbone_steps",
                              "head_lr", "warmup_fraction", "loss"})
#: Options that no longer exist but that checkpoints may record (``cuda_graphs``, ``engine``: how
#: steps ran, not what was trained); dropped wherever a checkpoint's hyperparameters are read.
RETIRED_HPARAMS = frozenset({"cuda_graphs", "engine"})


class HParams(dict):
    """Hyperparameters read as ``hparams.name`` or ``hparams["name"]``."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class PredictionModel(nn.Module):
    """The backbone (``model``) and ``predict_step`` of a ``GraphormerModule``, built from its
    checkpoint's hyperparameters (:meth:`DataFacts.nest`: either form of the facts): ``facts``,
    ``preset``, ``backbone`` and ``target_names`` (training-only ones are accepted and ignored;
    any other unknown one is a TypeError); it loads the ``state_dict`` unchanged."""

    def __init__(self, facts: DataFacts | Mapping[str, Any], preset: str = "slim",
                 backbone: GraphormerConfig | Mapping[str, Any] = GraphormerConfig(),
                 target_names: list[str] | None = None, **training: Any) -> None:
        super().__init__()
        unknown = sorted(set(training) - TRAINING_HPARAMS)
        if unknown:
            raise TypeError(f"unexpected hyperparameters {unknown}")
        self.facts = DataFacts.coerce(facts)  # TypeError for a missing vocabulary size
        self.model, resolved = build_backbone(self.facts, preset, backbone)
        self.task = get_task(self.facts.task)
        self.hparams = HParams(facts=self.facts.as_dict(), preset=preset, backbone=resolved.as_dict(),
                               target_names=target_names, **training)

    def forward(self, batch: GraphBatch) -> Tensor:
        """Raw model outputs ``[B, num_targets]`` (logits for classification)."""
        return self.model(batch)

    def predict_step(self, batch: GraphBatch, batch_idx: int = 0) -> dict[str, Tensor]:
        """As ``GraphormerModule.predict_step``: ``index`` and ``prediction`` (:meth:`Task.predictions`)."""
        return {"index": batch.index, "prediction": self.task.predictions(self(batch))}


class ModelEnsemble(nn.Module):
    """Models of one task predicting together (a deep ensemble: the same recipe trained with
    different seeds, Lakshminarayanan et al., 2017). ``prediction`` is the members' mean (of
    values, or of probabilities) and ``std`` their standard deviation over members (population),
    a measure of how much they disagree on a molecule. Members must share the featurizer, the
    encodings, the task and the targets (else a ValueError naming the first that differs;
    ``labels`` name the members in it, e.g. their checkpoint paths)."""

    def __init__(self, members: list[nn.Module], labels: list[str] | None = None) -> None:
        super().__init__()
        if len(members) < 2:
            raise ValueError(f"an ensemble needs at least two models, got {len(members)}")
        labels = labels or [f"model {k + 1}" for k in range(len(members))]
        first = members[0]
        for label, member in zip(labels[1:], members[1:]):
            for what, mine, theirs in (
                    ("data facts (featurizer, encodings, task, targets)",
                     member.facts.as_dict(), first.facts.as_dict()),
                    ("target names", member.hparams.get("target_names"), first.hparams.get("target_names"))):
                if mine != theirs:
                    raise ValueError(f"{label} cannot join an ensemble with {labels[0]}: other {what} "
                                     f"({mine} vs {theirs})")
        self.members = nn.ModuleList(members)
        self.facts, self.hparams = first.facts, first.hparams

    #: Predicts a ``std`` beside each prediction (:func:`~.table.prediction_columns`).
    predicts_std = True

    def predict_step(self, batch: GraphBatch, batch_idx: int = 0) -> dict[str, Tensor]:
        """``index``, ``prediction`` (the members' mean) and ``std`` (over members), ``[B, T]``."""
        each = torch.stack([member.predict_step(batch, batch_idx)["prediction"] for member in self.members])
        return {"index": batch.index, "prediction": each.mean(0), "std": each.std(0, correction=0)}


class MCDropout(nn.Module):
    """One model predicting ``samples`` times with its dropout on (Monte Carlo dropout, Gal and
    Ghahramani, 2016): ``prediction`` is the samples' mean and ``std`` their standard deviation
    (population), as :class:`ModelEnsemble` gives over models. A molecule's result depends on
    it, ``seed`` and ``samples`` alone, never on the molecules that share its file or batch:
    each is predicted on its own (:meth:`GraphBatch.alone`: no padding, so no mask is drawn for
    another molecule's atoms), its samples as copies of it in one batch (in groups of at most
    ``max_pairs`` padded pairs, so for a molecule larger than ``max_pairs / samples`` pairs
    also on ``max_pairs``), with masks drawn from ``seed`` and the molecule's content.
    ``ValueError`` for a model without dropout (every sample would agree)."""

    predicts_std = True

    def __init__(self, model: nn.Module, samples: int, seed: int = 0, max_pairs: int = DEFAULT_MAX_PAIRS) -> None:
        super().__init__()
        if samples < 2:
            raise ValueError(f"MC dropout needs at least 2 samples, got {samples}")
        rates = {k: model.hparams["backbone"].get(k, 0.0) for k in ("dropout", "attention_dropout", "activation_dropout")}
        if not any(rates.values()):
            raise ValueError(f"the model was trained without dropout ({', '.join(f'{k} 0' for k in rates)}): "
                             "its MC-dropout samples would all agree; use several checkpoints instead")
        self.model, self.samples, self.seed, self.max_pairs = model, int(samples), int(seed), int(max_pairs)
        self.facts, self.hparams = model.facts, model.hparams

    def predict_step(self, batch: GraphBatch, batch_idx: int = 0) -> dict[str, Tensor]:
        """``index``, ``prediction`` (the samples' mean) and ``std`` (over samples), ``[B, T]``."""
        each = torch.stack([self._samples_of(batch, g) for g in range(batch.num_graphs)], 1)  # [S, B, T]
        return {"index": batch.index, "prediction": each.mean(0), "std": each.std(0, correction=0)}

    def _samples_of(self, batch: GraphBatch, g: int) -> Tensor:
        """The ``[samples, T]`` predictions of graph ``g`` of ``batch`` with dropout on."""
        alone = batch.alone(g)
        # 32 bits: the CPU generator (a Mersenne Twister) keeps only a seed's low 32 bits
        key = zlib.crc32(str(self.seed).encode())
        for name, tensor in sorted(alone.tensors().items()):
            if name not in ("y", "index"):  # what the model reads: the molecule, not its row
                key = zlib.crc32(tensor.cpu().contiguous().numpy().tobytes(), key)
        group = min(self.samples, max(1, self.max_pairs // (int(alone.num_nodes[0]) + 1) ** 2))
        each = []
        with torch.random.fork_rng(devices=[batch.x.device] if batch.x.is_cuda else []), _dropout_on(self.model):
            for first in range(0, self.samples, group):
                torch.manual_seed(zlib.crc32(first.to_bytes(4, "little"), key))
                copies = batch.alone(g, min(group, self.samples - first))
                each.append(self.model.predict_step(copies)["prediction"])
        return torch.cat(each)


class ScaledStd(nn.Module):
    """A model that predicts a ``std`` (:class:`ModelEnsemble`, :class:`MCDropout`) with that std
    multiplied by one factor per target, fitted on molecules with measured values
    (:func:`~graphormer_urpe.prediction.uncertainty.std_scale`) so that it reads as a Gaussian's."""

    predicts_std = True

    def __init__(self, model: nn.Module, scale: Sequence[float]) -> None:
        super().__init__()
        self.model = model
        self.facts, self.hparams = model.facts, model.hparams
        self.register_buffer("scale", torch.tensor(list(scale), dtype=torch.float32))

    def predict_step(self, batch: GraphBatch, batch_idx: int = 0) -> dict[str, Tensor]:
        out = self.model.predict_step(batch, batch_idx)
        return {**out, "std": out["std"] * self.scale.to(out["std"].dtype)}


class WithEmbeddings(nn.Module):
    """One model's predictions with what its output head reads: ``embedding [B, D]``, each
    molecule's readout (the graph-token vector, the atoms' sum or both:
    :meth:`~graphormer_urpe.nn.graphormer.Graphormer.embed`),
    and with ``atoms`` also ``atom_embedding [B, N, D]``, each atom's final vector
    (:meth:`~graphormer_urpe.nn.graphormer.Graphormer.embed_atoms`; zero at padding). The
    prediction is the head applied to that embedding, as the model's ``forward`` computes it.
    ``ValueError`` for anything but one model (an ensemble, MC dropout): there, no one
    vector is what the prediction was made from."""

    def __init__(self, model: nn.Module, atoms: bool = False) -> None:
        super().__init__()
        if not isinstance(model, PredictionModel):
            raise ValueError("embeddings come from one model: give one --ckpt (a checkpoint, a run directory "
                             "or pretrained:<name>), without --mc-dropout")
        self.model, self.atoms = model, bool(atoms)
        self.facts, self.hparams = model.facts, model.hparams
        #: The width of a molecule's embedding (the readout's) and of an atom's (``D``).
        self.width, self.atom_width = model.model.readout_width, model.model.config.hidden_dim

    def predict_step(self, batch: GraphBatch, batch_idx: int = 0) -> dict[str, Tensor]:
        backbone = self.model.model
        if self.atoms:
            graph, atoms = backbone.embed_atoms(batch)
            extra = {"atom_embedding": atoms}
        else:
            graph, extra = backbone.embed(batch), {}
        return {"index": batch.index, "prediction": self.model.task.predictions(backbone.output(graph, batch)),
                "embedding": graph, **extra}


@contextlib.contextmanager
def _dropout_on(model: nn.Module) -> Iterator[None]:
    """Dropout layers in training mode inside the block (nothing else in the backbone depends on
    the mode), restored after."""
    was_training = model.training
    model.train()
    try:
        yield
    finally:
        model.train(was_training)


# ---------------------------------------------------------------------------- prediction
@dataclass
class RawChunk:
    """A chunk's accepted molecules, sorted by atom count, as flat raw feature arrays.

    ``position [G]`` (row within the chunk), ``x [sum n, F]``, ``node_ptr [G + 1]``,
    ``edge_index [2, sum E]`` (local ids), ``edge_attr [sum E, Fe]``, ``edge_ptr [G + 1]``,
    ``descriptors [G, D]`` (raw RDKit descriptors, for a model that reads them, else None);
    ``errors``: ``(row within chunk, reason)`` of the rejected rows.
    """

    position: np.ndarray
    x: np.ndarray
    node_ptr: np.ndarray
    edge_index: np.ndarray
    edge_attr: np.ndarray
    edge_ptr: np.ndarray
    errors: list[tuple[int, str]]
    descriptors: np.ndarray | None = None


def featurize_chunk(job: tuple[str, int, int, list[str]]) -> RawChunk:
    """``(featurizer, max_nodes, num_descriptors, smiles)`` -> :class:`RawChunk` (runs in
    worker processes); with ``num_descriptors`` > 0 each molecule's RDKit descriptors too, a
    molecule that gets none of them rejected."""
    from rdkit import RDLogger

    from graphormer_urpe.data.descriptors import descriptor_chunk
    from graphormer_urpe.data.featurize import atoms_over, featurizer_spec

    RDLogger.DisableLog("rdApp.*")  # reasons go into the output's error column instead
    name, max_nodes, num_descriptors, smiles = job
    spec = featurizer_spec(name)
    graphs, errors = [], []
    for position, text in enumerate(smiles):
        if not text.strip():
            errors.append((position, "empty SMILES"))
            continue
        atoms = atoms_over(text, max_nodes)
        if not atoms:
            try:
                x, edge_index, edge_attr = spec.graph_arrays(text)
            except ValueError as exc:
                errors.append((position, str(exc)))
                continue
            atoms = len(x)
        if atoms > max_nodes:
            errors.append((position, f"molecule has {atoms} atoms, more than max_nodes={max_nodes}"))
            continue
        graphs.append((len(x), position, x, edge_index, edge_attr))
    descriptors = descriptor_chunk([smiles[g[1]] for g in graphs]) if num_descriptors else None
    if descriptors is not None:
        none = np.isnan(descriptors).all(axis=1)
        errors += [(g[1], "RDKit computes none of the molecule's descriptors") for g in itertools.compress(graphs, none)]
        graphs, descriptors = [g for g, bad in zip(graphs, none) if not bad], descriptors[~none]
    order = sorted(range(len(graphs)), key=lambda k: graphs[k][0])  # stable: equal sizes keep input order
    graphs = [graphs[k] for k in order]
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
        descriptors=None if descriptors is None else descriptors[order],
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


def chunk_batches(facts: DataFacts, chunk: RawChunk, max_pairs: int, batch_size: int,
                  repeat: int = 1) -> Iterator[tuple[slice, GraphBatch]]:
    """The encoded, padded batches of a featurized chunk, sized by :func:`size_batches`: each
    with the slice of ``chunk.position`` it holds. ``repeat``: each graph that many times in a
    row (an integrated-gradients path, :mod:`graphormer_urpe.prediction.explain`)."""
    from graphormer_urpe.data.collate import collate
    from graphormer_urpe.data.encode import encode_flat
    from graphormer_urpe.data.featurize import featurizer_spec

    spec = featurizer_spec(facts.featurizer)
    node_ptr, edge_ptr = chunk.node_ptr, chunk.edge_ptr
    params = facts.encoding_params
    for g0, g1 in size_batches(np.diff(node_ptr), max_pairs, batch_size):
        n0, n1, e0, e1 = node_ptr[g0], node_ptr[g1], edge_ptr[g0], edge_ptr[g1]
        flat = encode_flat(chunk.x[n0:n1], node_ptr[g0:g1 + 1] - n0, chunk.edge_index[:, e0:e1],
                           chunk.edge_attr[e0:e1], edge_ptr[g0:g1 + 1] - e0,
                           np.full((g1 - g0, 1), np.nan, np.float32), params=params,
                           atom_feature_dims=spec.atom_feature_dims,
                           bond_feature_dims=spec.bond_feature_dims)
        descriptors = None if chunk.descriptors is None else np.repeat(chunk.descriptors[g0:g1], repeat, axis=0)
        yield slice(g0, g1), collate(flat, np.repeat(np.arange(g1 - g0), repeat), descriptors=descriptors)


@dataclass
class ChunkOutput:
    """What a model gives for one chunk's rows: ``predictions [rows, len(prediction_columns)]``
    (NaN for the rejected rows) and, from :class:`WithEmbeddings`, ``embeddings [rows, D]``
    (NaN there too) and ``atoms`` (each row's ``[atoms, D]``, ``None`` for a rejected row)."""

    predictions: np.ndarray
    embeddings: np.ndarray | None = None
    atoms: list[np.ndarray | None] | None = None


def predict_chunk(module, chunk: RawChunk, num_rows: int, max_pairs: int, batch_size: int) -> ChunkOutput:
    """The :class:`ChunkOutput` of one featurized chunk: the targets, then (an ensemble, MC
    dropout) their standard deviations; the embeddings of a :class:`WithEmbeddings`."""
    out = ChunkOutput(np.full((num_rows, len(prediction_columns(module))), np.nan, dtype=np.float32))
    if isinstance(module, WithEmbeddings):
        out.embeddings = np.full((num_rows, module.width), np.nan, dtype=np.float32)
        out.atoms = [None] * num_rows if module.atoms else None
    device = next(module.parameters()).device
    with torch.inference_mode():
        for graphs, batch in chunk_batches(module.facts, chunk, max_pairs, batch_size):
            step = module.predict_step(batch.to(device), 0)
            values = torch.cat([step["prediction"], step["std"]], 1) if "std" in step else step["prediction"]
            rows = chunk.position[graphs]
            out.predictions[rows] = values.cpu().numpy()
            if out.embeddings is not None:
                out.embeddings[rows] = step["embedding"].float().cpu().numpy()
            if out.atoms is not None:
                atoms, sizes = step["atom_embedding"].float().cpu().numpy(), np.diff(chunk.node_ptr)[graphs]
                for k, row in enumerate(rows):
                    out.atoms[row] = atoms[k, :sizes[k]]
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
    chunk = featurize_chunk((module.facts.featurizer, max_nodes, module.facts.num_descriptors,
                             [r.smiles for r in rows]))
    predictions = predict_chunk(module, chunk, len(rows), max_pairs, batch_size).predictions
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
    # One torch thread per process: processes scale over cores without OpenMP teams contending
    # (and a team in a forked child of a multi-threaded parent would deadlock in libgomp).
    torch.set_num_threads(1)
    _worker_module = module


def _chunk_job(job: tuple[str, int, int, int, int, list[str]]) -> tuple[RawChunk | ChunkOutput, list[tuple[int, str]]]:
    """In a worker: ``(featurizer, max_nodes, num_descriptors, max_pairs, batch_size, smiles)``
    -> (the :class:`ChunkOutput` when the worker holds the model, else the featurized chunk; the
    row errors)."""
    featurizer, max_nodes, num_descriptors, max_pairs, batch_size, smiles = job
    chunk = featurize_chunk((featurizer, max_nodes, num_descriptors, smiles))
    if _worker_module is None:
        return chunk, chunk.errors
    return predict_chunk(_worker_module, chunk, len(smiles), max_pairs, batch_size), chunk.errors


def stream_predictions(module, rows: Iterable[InputRow], table: PredictionTable, *, max_nodes: int,
                       max_pairs: int, batch_size: int, chunk_rows: int, workers: int, progress=None,
                       embeddings=None) -> None:
    """Predicts ``rows`` chunk by chunk and writes each chunk in input order (to ``table``, and
    its :class:`ChunkOutput` to ``embeddings.write(rows, output)`` when given:
    :class:`~graphormer_urpe.prediction.embeddings.EmbeddingFiles`).

    ``workers = 0``: everything in this process. Otherwise ``workers`` processes
    (:class:`~graphormer_urpe.utils.workers.WorkerProcesses`; no more than the usable cores nor
    than the input's chunks: :func:`~graphormer_urpe.utils.workers.useful_workers`) featurize
    the chunks and, when the model is on the CPU, also predict them with one torch thread each
    (on an accelerator this process predicts). At most ``2 * workers + 1`` chunks are in memory.
    """
    settings = (module.facts.featurizer, max_nodes, module.facts.num_descriptors, max_pairs, batch_size)

    def finish(chunk: list[InputRow], result: RawChunk | ChunkOutput, errors: list[tuple[int, str]]) -> None:
        output = (predict_chunk(module, result, len(chunk), max_pairs, batch_size)
                  if isinstance(result, RawChunk) else result)
        _finish_rows(chunk, errors, output.predictions)
        table.write(chunk, output.predictions)
        if embeddings is not None:
            embeddings.write(chunk, output)
        if progress is not None:
            progress.update(len(chunk))

    if workers == 0:
        for chunk in _chunks(rows, chunk_rows):
            featurized = featurize_chunk((*settings[:3], [r.smiles for r in chunk]))
            finish(chunk, featurized, featurized.errors)
        return
    on_cpu = next(module.parameters()).device.type == "cpu"
    chunks = _chunks(rows, chunk_rows)
    first = list(itertools.islice(chunks, useful_workers(workers)))  # one worker for each, at most
    if not first:
        return
    jobs = ((chunk, (*settings, [r.smiles for r in chunk])) for chunk in itertools.chain(first, chunks))
    with WorkerProcesses(len(first), _chunk_job, _init_worker, (module if on_cpu else None,)) as pool:
        for chunk, (result, errors) in pool.imap(jobs, ahead=2 * pool.workers + 1):
            finish(chunk, result, errors)

"""A trained model for prediction only: a checkpoint's backbone and output transform, no Lightning.

:class:`PredictionModel` builds the backbone as ``GraphormerModule`` does and loads a Lightning
checkpoint as it is, without importing Lightning (seconds of every start); the models around it
predict a spread (:class:`ModelEnsemble`, :class:`MCDropout`, :class:`ScaledStd`) or the
embeddings (:class:`WithEmbeddings`). :func:`predict_chunk` predicts one featurized chunk in
batches of molecules of similar size, at most ``max_pairs`` padded node pairs each.
"""
from __future__ import annotations

import ast
import functools
import importlib.util
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from graphormer_urpe.data.batch import GraphBatch
from graphormer_urpe.data.dataset import size_batches
from graphormer_urpe.data.facts import DataFacts
from graphormer_urpe.data.featurize import FeaturizedChunk, featurize_chunk
from graphormer_urpe.nn.graphormer import GraphormerConfig, build_backbone
from graphormer_urpe.data.task import get_task
from graphormer_urpe.prediction.table import InputRow, prediction_columns

#: Padded node pairs ``B * (N + 1)^2`` per batch (graph token included): ~100 ZINC molecules;
#: larger batches are slower on the CPU (their [B, H, N+1, N+1] tensors leave the caches). The
#: slim model's peak memory grows by ~0.2 KB per pair (README).
DEFAULT_MAX_PAIRS = 1 << 16
DEFAULT_BATCH_SIZE = 1024
DEFAULT_MAX_NODES = 512


@functools.cache
def module_arguments() -> frozenset[str]:
    """The names of ``GraphormerModule``'s arguments, read from its source (importing it would
    import Lightning)."""
    source = Path(importlib.util.find_spec("graphormer_urpe.training.module").origin).read_text(encoding="utf-8")
    module = next(node for node in ast.parse(source).body
                  if isinstance(node, ast.ClassDef) and node.name == "GraphormerModule")
    init = next(node for node in module.body if isinstance(node, ast.FunctionDef) and node.name == "__init__")
    return frozenset(arg.arg for arg in [*init.args.args[1:], *init.args.kwonlyargs])


class HParams(dict):
    """Hyperparameters read as ``hparams.name`` or ``hparams["name"]``."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class PredictionModel(nn.Module):
    """The backbone (``model``) and ``predict_step`` of a ``GraphormerModule``, built from its
    checkpoint's hyperparameters as the module builds it; the others are kept in ``hparams`` (a
    name that is no argument of ``GraphormerModule`` is a TypeError)."""

    def __init__(self, facts: DataFacts | Mapping[str, Any], preset: str = "slim",
                 backbone: GraphormerConfig | Mapping[str, Any] = GraphormerConfig(),
                 target_names: list[str] | None = None, **training: Any) -> None:
        super().__init__()
        unknown = sorted(set(training) - module_arguments())
        if unknown:
            raise TypeError(f"unexpected hyperparameters {unknown}")
        self.facts = DataFacts.coerce(facts)  # TypeError for a missing vocabulary size
        self.model, resolved = build_backbone(self.facts, preset, backbone)
        self.task = get_task(self.facts.task)
        self.hparams = HParams(facts=self.facts.as_dict(), preset=preset, backbone=resolved.as_dict(),
                               target_names=target_names, **training)

    def forward(self, batch: GraphBatch) -> Tensor:
        return self.model(batch)

    def predict_step(self, batch: GraphBatch, batch_idx: int = 0) -> dict[str, Tensor]:
        """As ``GraphormerModule.predict_step``."""
        return {"index": batch.index, "prediction": self.task.predictions(self(batch))}


class ModelEnsemble(nn.Module):
    """Models of one task predicting together (a deep ensemble, Lakshminarayanan et al., 2017):
    ``prediction`` is the members' mean and ``std`` their population standard deviation. Members
    must share the data facts and the targets (else a ValueError naming the first that differs,
    by its ``labels``)."""

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
        each = torch.stack([member.predict_step(batch, batch_idx)["prediction"] for member in self.members])
        return {"index": batch.index, "prediction": each.mean(0), "std": each.std(0, correction=0)}


class MCDropout(nn.Module):
    """One model predicting ``samples`` times with its dropout on (Monte Carlo dropout, Gal and
    Ghahramani, 2016), as :class:`ModelEnsemble` over models. A molecule's result depends on it,
    ``seed`` and ``samples`` alone, never on its file or batch: it is predicted on its own, its
    samples as copies in groups of at most ``max_pairs`` padded pairs, with masks drawn from
    ``seed`` and its content. ``ValueError`` for a model without dropout."""

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
        each, was_training = [], self.model.training
        with torch.random.fork_rng(devices=[batch.x.device] if batch.x.is_cuda else []):
            self.model.train()  # dropout on: nothing else in the backbone depends on the mode
            try:
                for first in range(0, self.samples, group):
                    torch.manual_seed(zlib.crc32(first.to_bytes(4, "little"), key))
                    copies = batch.alone(g, min(group, self.samples - first))
                    each.append(self.model.predict_step(copies)["prediction"])
            finally:
                self.model.train(was_training)
        return torch.cat(each)


class ScaledStd(nn.Module):
    """A model that predicts a ``std``, that std multiplied by one factor per target
    (:func:`~graphormer_urpe.prediction.uncertainty.std_scale`)."""

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
    """One model's predictions with what its output head reads: ``embedding [B, D]`` (the
    readout) and, with ``atoms``, ``atom_embedding [B, N, D]``; ``ValueError`` for anything but
    one model, where no one vector is what the prediction was made from."""

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


# ---------------------------------------------------------------------------- prediction
def chunk_batches(facts: DataFacts, chunk: FeaturizedChunk, max_pairs: int, batch_size: int,
                  repeat: int = 1) -> Iterator[tuple[np.ndarray, GraphBatch]]:
    """The padded batches of a featurized chunk, of molecules of similar size, each with its
    graphs' indices in the chunk; ``repeat``: each graph that many times in a row."""
    from graphormer_urpe.data.batch import collate
    from graphormer_urpe.data.graphs import encode_flat
    from graphormer_urpe.data.featurize import featurizer_spec

    spec = featurizer_spec(facts.featurizer)
    for graphs in size_batches(np.diff(chunk.node_ptr), batch_size, max_pairs):
        part = chunk.take(graphs)
        flat = encode_flat(part.x, part.node_ptr, part.edge_index, part.edge_attr, part.edge_ptr,
                           np.full((len(graphs), 1), np.nan, np.float32), params=facts.encoding_params,
                           atom_feature_dims=spec.atom_feature_dims, bond_feature_dims=spec.bond_feature_dims)
        descriptors = None if part.descriptors is None else np.repeat(part.descriptors, repeat, axis=0)
        yield graphs, collate(flat, np.repeat(np.arange(len(graphs)), repeat), descriptors=descriptors)


def featurize_rows(facts: DataFacts, smiles: Sequence[str], max_nodes: int) -> FeaturizedChunk:
    """The graphs of ``smiles`` as a model of these ``facts`` reads them."""
    return featurize_chunk(facts.featurizer, smiles, max_nodes, descriptors=bool(facts.num_descriptors))


@dataclass
class ChunkOutput:
    """What a model gives for one chunk's rows (NaN or ``None`` for a rejected row)."""

    predictions: np.ndarray
    embeddings: np.ndarray | None = None
    atoms: list[np.ndarray | None] | None = None


def predict_chunk(module, chunk: FeaturizedChunk, num_rows: int, max_pairs: int, batch_size: int) -> ChunkOutput:
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


def finish_rows(rows: Sequence[InputRow], errors: list[tuple[int, str]], output: ChunkOutput) -> None:
    """Each row's reason for having no prediction, and NaN (no atoms) in ``output`` for it."""
    for position, reason in errors:
        rows[position].error = rows[position].error or reason
    for position in np.flatnonzero(~np.isfinite(output.predictions).all(axis=1)):
        rows[position].error = rows[position].error or "prediction is not finite"
    failed = np.array([bool(row.error) for row in rows], dtype=bool)
    output.predictions[failed] = np.nan
    if output.embeddings is not None:
        output.embeddings[failed] = np.nan
    if output.atoms is not None:
        for position in np.flatnonzero(failed):
            output.atoms[position] = None


def predict_smiles(module, rows: list[InputRow], max_nodes: int = DEFAULT_MAX_NODES,
                   max_pairs: int = DEFAULT_MAX_PAIRS,
                   batch_size: int = DEFAULT_BATCH_SIZE) -> np.ndarray:
    """``[len(rows), num_targets]`` predictions in this process; NaN (with ``row.error`` set)
    where impossible."""
    chunk = featurize_rows(module.facts, [r.smiles for r in rows], max_nodes)
    output = predict_chunk(module, chunk, len(rows), max_pairs, batch_size)
    finish_rows(rows, chunk.errors, output)
    return output.predictions

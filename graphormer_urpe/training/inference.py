"""A trained model for prediction only: a checkpoint's backbone and output transform, no Lightning.

:class:`~graphormer_urpe.training.module.GraphormerModule` builds its backbone and turns outputs
into predictions with the functions here, so both give the same predictions from the same
weights; prediction alone (``graphormer-urpe-predict``) uses :class:`InferenceModel`, which
loads a Lightning checkpoint's ``state_dict`` and ``hyper_parameters`` as they are without
importing Lightning (several seconds of every start).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from graphormer_urpe.data.batch import GraphBatch
from graphormer_urpe.nn.graphormer import PRESETS, Graphormer, GraphormerConfig
from graphormer_urpe.training.task import get_task

#: Hyperparameters of ``GraphormerModule`` that only training uses.
TRAINING_HPARAMS = frozenset({"lr", "end_lr", "warmup_steps", "total_steps", "power", "weight_decay",
                              "betas", "eps", "no_weight_decay", "compile", "cuda_graphs",
                              "matmul_precision", "init_from", "reinit_head", "freeze_backbone_steps",
                              "head_lr", "warmup_fraction", "engine"})


def build_backbone(num_atom_embeddings: int, num_bond_embeddings: int, num_targets: int, max_hops: int,
                   task: str, preset: str, backbone: GraphormerConfig | Mapping[str, Any],
                   node_encodings: Mapping[str, int] | None = None) -> tuple[Graphormer, GraphormerConfig]:
    """The :class:`Graphormer` of these hyperparameters and its complete config (``backbone``'s
    fields over the preset's); ValueError for an unknown preset or task. ``node_encodings`` None
    (a checkpoint from before it existed) is none."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    task = get_task(task)
    task.check_num_targets(num_targets)
    if isinstance(backbone, Mapping):  # a checkpoint's hyperparameters
        backbone = GraphormerConfig.from_dict(backbone)
    resolved = backbone.over(PRESETS[preset])
    model = Graphormer(num_atom_embeddings=num_atom_embeddings, num_bond_embeddings=num_bond_embeddings,
                       num_targets=task.head_width(num_targets), max_hops=max_hops, node_encodings=node_encodings,
                       **resolved.as_dict())
    return model, resolved


class HParams(dict):
    """Hyperparameters read as ``hparams.name`` or ``hparams["name"]``."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class InferenceModel(nn.Module):
    """The backbone (``model``) and ``predict_step`` of a ``GraphormerModule``, built from its
    checkpoint's hyperparameters (training-only ones are accepted and ignored; any other unknown
    one is a TypeError) and loading its ``state_dict`` unchanged."""

    def __init__(self, num_atom_embeddings: int, num_bond_embeddings: int, num_targets: int = 1,
                 max_hops: int = 5, task: str = "regression", featurizer: str = "zinc",
                 preset: str = "slim", backbone: GraphormerConfig | Mapping[str, Any] = GraphormerConfig(),
                 target_names: list[str] | None = None, node_encodings: dict[str, int] | None = None,
                 **training: Any) -> None:
        super().__init__()
        unknown = sorted(set(training) - TRAINING_HPARAMS)
        if unknown:
            raise TypeError(f"unexpected hyperparameters {unknown}")
        self.model, resolved = build_backbone(num_atom_embeddings, num_bond_embeddings, num_targets,
                                              max_hops, task, preset, backbone, node_encodings)
        self.task = get_task(task)
        self.hparams = HParams(num_atom_embeddings=num_atom_embeddings,
                               num_bond_embeddings=num_bond_embeddings, num_targets=num_targets,
                               max_hops=max_hops, task=task, featurizer=featurizer, preset=preset,
                               backbone=resolved.as_dict(), target_names=target_names,
                               node_encodings=node_encodings, **training)

    def forward(self, batch: GraphBatch) -> Tensor:
        """Raw model outputs ``[B, num_targets]`` (logits for classification)."""
        return self.model(batch)

    def predict_step(self, batch: GraphBatch, batch_idx: int = 0) -> dict[str, Tensor]:
        """As ``GraphormerModule.predict_step``: ``index`` and ``prediction`` (:meth:`Task.predictions`)."""
        return {"index": batch.index, "prediction": self.task.predictions(self(batch))}

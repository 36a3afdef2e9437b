"""The facts a model takes from its data, declared once.

A DataModule exposes each field of :class:`DataFacts` as an attribute of the same name; the CLI
links each of them into ``GraphormerModule``'s init argument of that name, a checkpoint records
them among its hyperparameters, and :func:`~graphormer_urpe.training.inference.build_backbone`
builds the backbone from them.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class DataFacts:
    """Args:
        num_atom_embeddings, num_bond_embeddings: embedding table sizes, padding id 0 included.
        num_targets: outputs per graph (for ``multiclass``, the number of classes).
        max_hops: hops of each shortest path the edge encoding reads.
        task: ``regression``, ``classification`` or ``multiclass``
            (:data:`~graphormer_urpe.task.TASKS`).
        featurizer: how SMILES become graphs (``zinc`` or ``ogb``), so inference can redo it.
        node_encodings: ``{name: width}`` of the optional per-node encodings (e.g.
            ``{"rwse": 16}``); None (a checkpoint from before they existed): none.
    """

    num_atom_embeddings: int
    num_bond_embeddings: int
    num_targets: int = 1
    max_hops: int = 5
    task: str = "regression"
    featurizer: str = "zinc"
    node_encodings: dict[str, int] | None = None

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def split(cls, hparams: Mapping[str, Any]) -> tuple["DataFacts", dict[str, Any]]:
        """The facts among ``hparams`` (missing optional ones at their defaults) and the rest."""
        names = cls.names()
        facts = cls(**{k: v for k, v in hparams.items() if k in names})
        return facts, {k: v for k, v in hparams.items() if k not in names}

    @classmethod
    def of_hparams(cls, hparams: Mapping[str, Any]) -> "DataFacts":
        """The facts a checkpoint's hyperparameters record; optional ones an older checkpoint
        lacks at their defaults (TypeError for a missing vocabulary size)."""
        return cls.split(hparams)[0]

    @classmethod
    def of(cls, data: Any) -> "DataFacts":
        """The facts a DataModule exposes (the attributes the CLI links)."""
        return cls(**{name: getattr(data, name) for name in cls.names()})

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.names()}

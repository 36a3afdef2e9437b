"""The facts a model takes from its data, declared once (:class:`DataFacts`): a DataModule exposes
each as an attribute, the CLI links them into ``GraphormerModule``'s ``facts``, a checkpoint
records them as ``hyper_parameters["facts"]`` (older ones as separate hyperparameters, which
:meth:`DataFacts.nest` reads too)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any

from graphormer_urpe.data.encodings import EncodingParams


#: The ``K`` of a checkpoint that does not record ``max_hops`` (all such were trained with 5).
UNRECORDED_MAX_HOPS = 5


@dataclass(frozen=True)
class DataFacts:
    """Args:
        num_atom_embeddings, num_bond_embeddings: embedding table sizes, padding id 0 included.
        num_targets: outputs per graph (for ``multiclass``, the number of classes).
        max_hops: hops of each shortest path the edge encoding reads.
        task: ``regression``, ``classification`` or ``multiclass``.
        featurizer: how SMILES become graphs (``zinc`` or ``ogb``), so inference can redo it.
        node_encodings: ``{name: width}`` of the optional per-node encodings; None: none.
        num_descriptors: RDKit descriptors per molecule the head reads beside the readout; 0: none."""

    num_atom_embeddings: int
    num_bond_embeddings: int
    num_targets: int = 1
    max_hops: int = UNRECORDED_MAX_HOPS
    task: str = "regression"
    featurizer: str = "zinc"
    node_encodings: dict[str, int] | None = None
    num_descriptors: int = 0

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def coerce(cls, value: "DataFacts | Mapping[str, Any]") -> "DataFacts":
        """``value`` itself, or the facts of a plain dict (a checkpoint's ``facts``)."""
        return value if isinstance(value, cls) else cls(**value)

    @classmethod
    def nest(cls, hparams: Mapping[str, Any]) -> dict[str, Any]:
        """A checkpoint's hyperparameters with the facts as one ``facts`` dict (moved there from
        separate hyperparameters)."""
        if "facts" in hparams:
            return dict(hparams)
        names = cls.names()
        return {**{k: v for k, v in hparams.items() if k not in names},
                "facts": {k: v for k, v in hparams.items() if k in names}}

    @classmethod
    def of_hparams(cls, hparams: Mapping[str, Any]) -> "DataFacts":
        """The facts a checkpoint records (either form); missing optional ones at their defaults."""
        return cls.coerce(cls.nest(hparams)["facts"])

    @classmethod
    def recorded(cls, hparams: Mapping[str, Any], name: str, default: Any = MISSING) -> Any:
        """One fact as a checkpoint records it, else ``default``, else the field's default (None for the
        vocabulary sizes)."""
        if default is MISSING:
            field = next(f for f in fields(cls) if f.name == name)
            default = None if field.default is MISSING else field.default
        return cls.nest(hparams)["facts"].get(name, default)

    @classmethod
    def of(cls, data: Any) -> "DataFacts":
        """The facts a DataModule exposes (the attributes the CLI links)."""
        return cls(**{name: getattr(data, name) for name in cls.names()})

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.names()}

    @property
    def encoding_params(self) -> EncodingParams:
        return EncodingParams.of_model(self.max_hops, self.node_encodings)


def check_checkpoint_encodings(saved: Mapping[str, Any], current: DataFacts) -> None:
    """ValueError naming the data options to change unless a checkpoint's model (``saved``) reads the
    encodings of the data's facts (``current``); one without ``max_hops`` is not checked."""
    max_hops = DataFacts.recorded(saved, "max_hops")
    if max_hops is None:
        return
    theirs = EncodingParams.of_model(max_hops, DataFacts.recorded(saved, "node_encodings"))
    ours = current.encoding_params
    if theirs != ours:
        options = " ".join(f"--data.init_args.{name} {value}" for name, value in theirs.as_dict().items()
                           if value != getattr(ours, name))
        raise ValueError(f"the checkpoint was trained on data with {theirs.describe()} but this data has "
                         f"{ours.describe()}: run with {options}")

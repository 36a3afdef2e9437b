"""The facts a model takes from its data, declared once (:class:`DataFacts`): a DataModule exposes
each as an attribute, the CLI links them into ``GraphormerModule``'s ``facts``, a checkpoint
records them as ``hyper_parameters["facts"]`` (older ones as separate hyperparameters, which
:meth:`DataFacts.nest` reads too)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any

from graphormer_urpe.data.encodings import EncodingParams


#: The ``K`` of a checkpoint that does not record ``max_hops``: such checkpoints were all trained
#: with 5, so it stays 5 whatever :data:`~.encodings.DEFAULT_MAX_HOPS` (new runs) becomes.
UNRECORDED_MAX_HOPS = 5


@dataclass(frozen=True)
class DataFacts:
    """Args:
        num_atom_embeddings, num_bond_embeddings: embedding table sizes, padding id 0 included.
        num_targets: outputs per graph (for ``multiclass``, the number of classes).
        max_hops: hops of each shortest path the edge encoding reads (absent from the oldest
            checkpoints: :data:`UNRECORDED_MAX_HOPS`).
        task: ``regression``, ``classification`` or ``multiclass``
            (:data:`~graphormer_urpe.data.task.TASKS`).
        featurizer: how SMILES become graphs (``zinc`` or ``ogb``), so inference can redo it.
        node_encodings: ``{name: width}`` of the optional per-node encodings (e.g.
            ``{"rwse": 16}``); None (a checkpoint from before they existed): none.
        num_descriptors: how many RDKit descriptors of each molecule its batches carry and the
            model's head reads beside the readout (:mod:`.descriptors`); 0: none.
    """

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
        """A checkpoint's hyperparameters with the facts as one ``facts`` dict, as
        ``GraphormerModule`` takes them; a checkpoint that keeps each fact as a hyperparameter of
        its own has them moved into it."""
        if "facts" in hparams:
            return dict(hparams)
        names = cls.names()
        return {**{k: v for k, v in hparams.items() if k not in names},
                "facts": {k: v for k, v in hparams.items() if k in names}}

    @classmethod
    def of_hparams(cls, hparams: Mapping[str, Any]) -> "DataFacts":
        """The facts a checkpoint's hyperparameters record (either form: :meth:`nest`); optional
        ones an older checkpoint lacks at their defaults (TypeError for a missing vocabulary
        size)."""
        return cls.coerce(cls.nest(hparams)["facts"])

    @classmethod
    def recorded(cls, hparams: Mapping[str, Any], name: str, default: Any = MISSING) -> Any:
        """One fact as a checkpoint's hyperparameters record it (either form); where they do not
        (a weights-only checkpoint may record none), ``default``, else the field's default
        (None for the vocabulary sizes)."""
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
        """The parameters of the encodings a model of these facts reads (``max_hops`` and the
        node encodings' widths), as a DataModule's ``encoding_params`` holds them."""
        return EncodingParams.of_model(self.max_hops, self.node_encodings)


def check_checkpoint_encodings(saved: Mapping[str, Any], current: DataFacts) -> None:
    """ValueError unless a checkpoint's model (hyperparameters ``saved``) reads the encodings of
    the model about to load it (``current``: the data's facts), naming the data options to
    change; a checkpoint that records no ``max_hops`` is not checked."""
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

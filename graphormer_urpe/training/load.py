"""A model from a checkpoint, verified before use: :func:`load_module` reads a Lightning
checkpoint with :func:`~graphormer_urpe.checkpoint.read_checkpoint` (plain data, zip
CRCs checked), then checks that its weights are finite, that its hyperparameters build this
version's model for their featurizer and task, and that the model predicts a probe molecule; any
failure is a :class:`~graphormer_urpe.checkpoint.CheckpointError` naming the file.
"""
from __future__ import annotations

from pathlib import Path

import torch

from graphormer_urpe.checkpoint import CheckpointError, read_checkpoint
from graphormer_urpe.training.inference import RETIRED_HPARAMS, predict_smiles
from graphormer_urpe.training.predictions import InputRow

#: A molecule every featurizer accepts: a loaded model must predict it (hand-edited checkpoints).
_PROBE_SMILES = "CCO"


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
    from graphormer_urpe.data.facts import DataFacts
    from graphormer_urpe.data.features import num_embeddings
    from graphormer_urpe.data.featurize import featurizer_spec
    from graphormer_urpe.task import get_task

    if inference_only:
        from graphormer_urpe.training.inference import InferenceModel as model_class
    else:
        from graphormer_urpe.training.module import GraphormerModule as model_class

    ckpt = Path(ckpt)
    checkpoint = read_checkpoint(ckpt, map_location)
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict) \
            or not isinstance(checkpoint.get("hyper_parameters"), dict):
        raise CheckpointError(f"{ckpt} is not a Lightning checkpoint (no state_dict/hyper_parameters)")
    _check_finite(ckpt, checkpoint["state_dict"])
    hparams = DataFacts.nest(checkpoint["hyper_parameters"])  # either form of the facts
    for name in ("_instantiator", "_class_path", *RETIRED_HPARAMS):
        hparams.pop(name, None)
    hparams["compile"] = False  # inference needs no compile warm-up, whatever training used
    hparams["init_from"] = None  # its weights are in this checkpoint; the file may be gone
    try:
        facts = DataFacts.of_hparams(hparams)
        spec = featurizer_spec(facts.featurizer)
        get_task(facts.task)
        for kind, dims in (("atom", spec.atom_feature_dims), ("bond", spec.bond_feature_dims)):
            if getattr(facts, f"num_{kind}_embeddings") != num_embeddings(dims):
                raise ValueError(f"num_{kind}_embeddings={getattr(facts, f'num_{kind}_embeddings')!r} but "
                                 f"featurizer {spec.name!r} needs {num_embeddings(dims)}")
        module = model_class(**hparams)
        module.load_state_dict(checkpoint["state_dict"])
        module.eval()
        predict_smiles(module, [InputRow(_PROBE_SMILES)], max_nodes=8, batch_size=1)
    except Exception as exc:  # noqa: BLE001 - hand-edited hyperparameters fail in many ways
        raise CheckpointError(f"checkpoint {ckpt} does not match this version's GraphormerModule "
                              f"({type(exc).__name__}: {exc})") from None
    return module

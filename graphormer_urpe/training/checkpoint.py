"""Checkpoints of :class:`~graphormer_urpe.training.module.GraphormerModule` verified before use.

:func:`read_checkpoint` is the one way this package opens a torch file (a checkpoint, a model's
weights, a saved training state): as data only (``torch.load(weights_only=True)``: never code to
run) after checking its zip CRCs. :func:`load_module` reads a Lightning checkpoint with it, then
checks that its weights are finite, that its hyperparameters build this version's model for
their featurizer and task, and that the model predicts a probe molecule; any failure is a
:class:`CheckpointError` naming the file.
"""
from __future__ import annotations

import pickle
import zipfile
from pathlib import Path

import torch

from graphormer_urpe.files import unreadable_as_a_file
from graphormer_urpe.training.inference import RETIRED_HPARAMS, predict_smiles
from graphormer_urpe.training.predictions import InputRow

#: A molecule every featurizer accepts: a loaded model must predict it (hand-edited checkpoints).
_PROBE_SMILES = "CCO"


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable, damaged or not a graphormer-urpe model."""


def _verify_archive(ckpt: Path, what: str) -> None:
    import zlib

    if not zipfile.is_zipfile(ckpt):
        raise CheckpointError(f"{what} {ckpt} cannot be read: not a PyTorch checkpoint archive "
                              "(truncated, damaged or another kind of file)")
    try:
        with zipfile.ZipFile(ckpt) as archive:
            damaged = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, zlib.error) as exc:
        raise CheckpointError(f"{what} {ckpt} cannot be read: damaged archive ({exc})") from None
    if damaged is not None:
        raise CheckpointError(f"{what} {ckpt} is damaged: its entry {damaged} fails the CRC check")


def _check_finite(ckpt: Path, state_dict: dict) -> None:
    bad = [name for name, value in state_dict.items()
           if isinstance(value, torch.Tensor) and value.is_floating_point() and not torch.isfinite(value).all()]
    if bad:
        raise CheckpointError(f"checkpoint {ckpt} has non-finite weights (NaN or inf) in {len(bad)} "
                              f"tensor(s): {', '.join(bad[:5])}")


def read_checkpoint(path: str | Path, map_location="cpu", *, what: str = "checkpoint"):
    """The content of the torch file ``path`` (``what`` it is, for the messages), read as plain
    data: tensors, numbers, strings and containers of them, never objects whose unpickling runs
    code. :class:`CheckpointError` naming the file when it is missing, a damaged archive (zip
    CRCs), or holds anything else (a crafted file refused here has not run anything)."""
    path = Path(path)
    problem = unreadable_as_a_file(path)
    if problem:
        raise CheckpointError(f"{what} {path} {problem}")
    _verify_archive(path, what)
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError:
        raise CheckpointError(f"{what} {path} cannot be read: it holds objects other than "
                              "tensors and plain values, which are never loaded") from None
    except Exception as exc:  # noqa: BLE001 - any failure of a verified archive is a bad file
        reason = str(exc).splitlines()[0] if str(exc) else ""
        raise CheckpointError(f"{what} {path} cannot be read ({type(exc).__name__}: {reason})") from None


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

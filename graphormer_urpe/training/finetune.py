"""Fine-tuning: start a run from another run's backbone (``GraphormerModule(init_from=...)``).

Every backbone tensor of the checkpoint (a Lightning checkpoint of this project, or a
weights-only ``state_dict``) is loaded before the first step; the output head only where it fits
(same task and targets, no ``reinit_head``). Any other misfit stops the run naming every tensor
with both shapes; nothing is loaded half-way.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from graphormer_urpe.prediction import pretrained
from graphormer_urpe.data.facts import DataFacts
from graphormer_urpe.utils.torch_files import CheckpointError, read_checkpoint

log = logging.getLogger(__name__)

#: Parameter-name prefix of the output head in the backbone (``Graphormer.head``).
HEAD_PREFIX = "head."
#: The atom embedding table every Graphormer backbone has (a sequence model has none).
ATOM_EMBEDDING = "atom_encoder.embedding.weight"


class InitFromError(ValueError):
    """A checkpoint given as ``init_from`` that cannot start this model (one clear message)."""


def read_backbone_state(path: str | Path) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """``(backbone state_dict, hyperparameters or {})`` of a training or weights-only checkpoint,
    or of a shipped backbone (``pretrained:<name>``, :mod:`graphormer_urpe.prediction.pretrained`)."""
    try:
        path = pretrained.resolve(path)
    except ValueError as exc:
        raise InitFromError(str(exc)) from None
    try:
        checkpoint = read_checkpoint(path)
    except CheckpointError as exc:
        raise InitFromError(f"model.init_from: {exc}") from None
    hparams: dict[str, Any] = {}
    if isinstance(checkpoint, Mapping) and isinstance(checkpoint.get("state_dict"), Mapping):
        state, hparams = checkpoint["state_dict"], dict(checkpoint.get("hyper_parameters") or {})
    else:
        state = checkpoint
    if not isinstance(state, Mapping) or not state or not all(
            isinstance(k, str) and isinstance(v, Tensor) for k, v in state.items()):
        raise InitFromError(f"model.init_from: {path} is neither a Lightning checkpoint nor a "
                            "state_dict of tensors")
    if any(k.startswith("model.") for k in state):  # the LightningModule's: its backbone is `model`
        state = {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
    return dict(state), hparams


def fit_state(model: nn.Module, state: Mapping[str, Tensor], hparams: Mapping[str, Any], task: str,
              reinit_head: bool, source: str) -> tuple[dict[str, Tensor], str | None]:
    """``(the state_dict to load into model, why the head is re-initialised or None)``;
    :class:`InitFromError` listing every backbone tensor that does not fit."""
    own = model.state_dict()
    misfits = []
    for name in sorted(set(own) | set(state)):
        if name.startswith(HEAD_PREFIX):
            continue
        if name not in state:
            misfits.append(f"{name}: model {list(own[name].shape)}, not in the checkpoint")
        elif name not in own:
            misfits.append(f"{name}: checkpoint {list(state[name].shape)}, not in this model")
        elif state[name].shape != own[name].shape:
            misfits.append(f"{name}: checkpoint {list(state[name].shape)}, model {list(own[name].shape)}")
    if misfits:
        raise InitFromError(
            f"model.init_from: {len(misfits)} tensor(s) of {source} do not fit this model, nothing "
            "was loaded (the preset / backbone, the data's featurizer and max_hops must be the "
            "checkpoint's):\n  " + "\n  ".join(misfits))
    heads = {name for name in own if name.startswith(HEAD_PREFIX)}
    reason = None
    theirs = DataFacts.recorded(hparams, "task", task)
    if reinit_head:
        reason = "reinit_head is set"
    elif theirs != task:
        reason = f"the checkpoint's task is {theirs!r}, this run's {task!r}"
    elif any(name not in state or state[name].shape != own[name].shape for name in heads):
        widths = [list(state[n].shape) if n in state else None for n in sorted(heads)]
        reason = f"the checkpoint's head {widths} differs from this model's {[list(own[n].shape) for n in sorted(heads)]}"
    fitted = {name: (own[name] if name.startswith(HEAD_PREFIX) and reason else state[name]) for name in own}
    return fitted, reason


def load_backbone(module, path: str | Path, reinit_head: bool = False) -> None:
    """Load ``path``'s backbone into ``module.model`` (a ``GraphormerModule``), head included
    where it fits (module docstring); logs what was loaded."""
    state, hparams = read_backbone_state(path)
    if ATOM_EMBEDDING not in state:  # before a fact that it does not record is blamed
        raise InitFromError(
            f"model.init_from: {path} is not a Graphormer checkpoint: it has no atom embedding "
            f"{ATOM_EMBEDDING} (its tensors: {', '.join(sorted(state)[:3])}, ...); give a checkpoint "
            "of graphormer-urpe fit (a sequence model of graphormer-urpe-synthetic cannot start a graph model)")
    ours, theirs = module.facts.featurizer, DataFacts.recorded(hparams, "featurizer", None)
    if theirs is not None and theirs != ours:
        raise InitFromError(
            f"model.init_from: {path} was trained on the {theirs!r} featurizer but the data uses "
            f"{ours!r}: their atom and bond vocabularies differ (for a CSV set "
            f"data.init_args.featurizer {theirs})")
    fitted, reason = fit_state(module.model, state, hparams, module.facts.task, reinit_head, str(path))
    module.model.load_state_dict(fitted)
    log.info("init_from %s: loaded %d backbone tensors; %s", path,
             sum(not n.startswith(HEAD_PREFIX) for n in fitted),
             f"output head re-initialised ({reason})" if reason else "output head loaded too")


#: Parameter-name prefixes of the encoder stack above the input encoders: layer ``i``'s own
#: parameters are ``layers.i.*`` and ``urpe_scales.i.*``.
_LAYER_PREFIXES = ("layers.", "urpe_scales.")


def _trained(name: str, head_only: bool, frozen_layers: int) -> bool:
    """Whether parameter ``name`` gets a gradient: the head always; with ``head_only`` nothing
    else; with ``frozen_layers`` neither the first layers nor what feeds them (the atom, degree
    and node encoders, the graph token, the attention biases B that every layer reads)."""
    if name.startswith(HEAD_PREFIX):
        return True
    if head_only:
        return False
    if name.startswith("final_norm."):
        return True
    if name.startswith(_LAYER_PREFIXES):
        return int(name.split(".")[1]) >= frozen_layers
    return frozen_layers == 0


def set_trainable(model: nn.Module, head_only: bool, frozen_layers: int = 0) -> None:
    """Switch gradients on or off (:func:`_trained`): AdamW skips parameters without one, and a
    frozen stack below the first trained layer needs no backward pass."""
    state = (head_only, frozen_layers)
    if getattr(model, "_trainable_state", (False, 0)) == state:
        return
    for name, param in model.named_parameters():
        param.requires_grad_(_trained(name, head_only, frozen_layers))
    model._trainable_state = state

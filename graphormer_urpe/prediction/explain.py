r"""Which atoms drive a prediction (``graphormer-urpe-explain``): one number per atom, drawn on
the molecule.

Attribution by integrated gradients (Sundararajan, Taly and Yan, 2017) on each atom's input
vector :math:`h_i` (its atom and degree embeddings plus any node encodings,
:meth:`~graphormer_urpe.nn.graphormer.Graphormer.node_features`), along the straight path from
the baseline :math:`b` to the molecule, where every atom of :math:`b` is the molecule's mean
atom :math:`\bar h` (the bonds, the shortest paths and the graph token unchanged):

.. math::
    a_i = (h_i - \bar h) \cdot \frac{1}{S} \sum_{k=1}^{S}
          \frac{\partial f}{\partial h_i}\Big(b + \tfrac{k - 1/2}{S}\,(h - b)\Big),

summed over the embedding's dimensions: one number per atom. The contributions add up to
:math:`f(h) - f(b)` up to the quadrature error (completeness), which every row reports as
``gap``. (A zero baseline would not do: the first layer normalises each atom's vector, so the
output barely moves along most of the path from 0 and then jumps next to it.) :math:`f` is the
model's raw output for the target: the value (regression), the logit (classification), the
class's logit (multiclass).

The attention view (:func:`graph_token_attention`) is a second, cheaper one: the attention the
graph token (whose final state the prediction head reads) pays to each atom in the last layer,
averaged over the heads; with URPE after the scale ``C``, so a molecule's weights need not add up
to 1. It says where the last layer looks, not how each atom moves the output (no sign, no
completeness).

Several models (a :class:`~graphormer_urpe.prediction.model.ModelEnsemble`) explain their mean:
the mean of their attributions explains their mean output (integrated gradients is linear in the
function), and the spread of their predictions comes as ``std``.

:func:`explain_smiles` gives the attributions; the command draws them
(:mod:`graphormer_urpe.cli.explain`: the pictures, ``attributions.csv`` and ``index.html``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from graphormer_urpe.data.batch import GraphBatch
from graphormer_urpe.data.task import get_task
from graphormer_urpe.prediction.model import DEFAULT_MAX_NODES, ModelEnsemble, chunk_batches, featurize_rows

DEFAULT_STEPS = 32
#: Padded node pairs per integrated-gradients batch (molecules x path points x (N + 1)^2).
MAX_PAIRS = 1 << 17
#: What ``--view`` draws: integrated gradients, or the graph token's attention.
VIEWS = ("gradients", "attention")


@dataclass
class Explanation:
    """One molecule's attribution: the contributions ``atoms [n]`` (RDKit's atom order), the raw
    output ``f(h)`` and baseline ``f(b)`` of the target, its prediction (the task's transform of
    ``f(h)``) and ``gap = sum(atoms) - (output - baseline)``, the quadrature error."""

    atoms: np.ndarray
    output: float
    baseline: float
    prediction: float
    #: with several checkpoints: the std of their predictions (each field above is their mean)
    std: float | None = None

    @property
    def gap(self) -> float:
        return float(self.atoms.sum() - (self.output - self.baseline))


def integrated_gradients(module, batch: GraphBatch, steps: int, target: int) -> list[Explanation]:
    """Attributions for the molecules of ``batch``, each present ``steps + 2`` times in a row
    (:func:`~.prediction.model.chunk_batches` with ``repeat``): copy 0 is the baseline, copy 1
    the molecule, copies 2.. the midpoints of the path."""
    model = module.model
    per_graph = steps + 2
    graphs = batch.num_graphs // per_graph
    real = batch.node_mask[..., None]
    with torch.no_grad():
        nodes = model.node_features(batch)  # [G * (S + 2), N, D]; a molecule's copies are equal
        mean = (nodes * real).sum(1, keepdim=True) / real.sum(1, keepdim=True).clamp_min(1)
        baseline = torch.where(real, mean, nodes)  # every atom the molecule's mean atom
    alphas = torch.cat([torch.tensor([0.0, 1.0]), (torch.arange(steps, dtype=torch.float32) + 0.5) / steps])
    alphas = alphas.to(nodes).repeat(graphs).view(-1, 1, 1)
    path = (baseline + alphas * (nodes - baseline)).requires_grad_()
    with torch.enable_grad():
        raw = model(batch, path).float()  # [G * (S + 2), head width]
        outputs = raw[:, target].view(graphs, per_graph)
        (gradients,) = torch.autograd.grad(outputs[:, 2:].sum(), path)
    shape = (graphs, per_graph, *nodes.shape[1:])
    contributions = ((nodes - baseline).view(shape)[:, 1] * gradients.view(shape)[:, 2:].mean(1)).sum(-1)
    atoms = batch.node_mask.view(graphs, per_graph, -1)[:, 0].sum(1).tolist()
    predictions = module.task.predictions(raw.detach().view(graphs, per_graph, -1)[:, 1])
    outputs = outputs.detach()
    return [Explanation(contributions[g, :atoms[g]].double().cpu().numpy(), float(outputs[g, 1]),
                        float(outputs[g, 0]), float(predictions[g, target])) for g in range(graphs)]


def graph_token_attention(module, batch: GraphBatch, target: int) -> list[Explanation]:
    """Per molecule of ``batch``: the last layer's attention from the graph token to each atom,
    averaged over heads (with URPE, after ``C``), as an :class:`Explanation` without baseline.
    The layer's weights are requested through hooks (eager kernel for that one call)."""
    model = module.model
    attention = model.layers[-1].attn
    captured: dict[str, Tensor] = {}

    def request(_, args, kwargs):
        return args, {**kwargs, "need_weights": True}

    def keep(_, args, kwargs, output):
        captured["weights"] = output[1]
        return output[0]

    kernel, attention.attention_impl = attention.attention_impl, "eager"
    hooks = [attention.register_forward_pre_hook(request, with_kwargs=True),
             attention.register_forward_hook(keep, with_kwargs=True)]
    try:
        with torch.no_grad():
            raw = model(batch).float()
    finally:
        attention.attention_impl = kernel
        for hook in hooks:
            hook.remove()
    weights = captured["weights"][:, :, 0, 1:].float().mean(1)  # [B, N]: token row, atom columns
    atoms = batch.node_mask.sum(1).tolist()
    predictions = module.task.predictions(raw)
    return [Explanation(weights[g, :atoms[g]].double().cpu().numpy(), float(raw[g, target]), float("nan"),
                        float(predictions[g, target])) for g in range(batch.num_graphs)]


def check_options(module, target: int, steps: int) -> None:
    """ValueError for a target the model does not output or fewer than one path point."""
    outputs = get_task(module.facts.task).head_width(module.facts.num_targets)
    if not 0 <= target < outputs:
        raise ValueError(f"--target {target}: the model has {outputs} outputs ({module.facts.task})")
    if steps < 1:
        raise ValueError(f"--steps must be >= 1, got {steps}")


def explain_smiles(module, smiles: list[str], steps: int = DEFAULT_STEPS, target: int = 0,
                   max_nodes: int = DEFAULT_MAX_NODES, view: str = "gradients") -> list[Explanation | str]:
    """Per SMILES its :class:`Explanation` in ``view`` (:data:`VIEWS`), or the reason it cannot
    be featurized. For a :class:`~.prediction.model.ModelEnsemble` every field is the mean over
    its models (the mean of their attributions explains their mean output: integrated gradients
    is linear in the function) and ``std`` the spread of their predictions."""
    if isinstance(module, ModelEnsemble):
        each = [explain_smiles(member, smiles, steps, target, max_nodes, view) for member in module.members]
        return [_mean_explanation(list(results)) for results in zip(*each)]
    check_options(module, target, steps)
    if view not in VIEWS:
        raise ValueError(f"view must be one of {VIEWS}, got {view!r}")
    module.eval()
    chunk = featurize_rows(module.facts, smiles, max_nodes)
    results: list[Explanation | str] = [""] * len(smiles)
    for position, reason in chunk.errors:
        results[position] = reason
    device = next(module.parameters()).device
    per_graph = steps + 2 if view == "gradients" else 1
    for graphs, batch in chunk_batches(module.facts, chunk, MAX_PAIRS // per_graph, max(1, 1024 // per_graph),
                                       repeat=per_graph):
        batch = batch.to(device)
        explained = (integrated_gradients(module, batch, steps, target) if view == "gradients"
                     else graph_token_attention(module, batch, target))
        for position, explanation in zip(chunk.position[graphs], explained):
            results[position] = explanation
    return results


def _mean_explanation(results: list[Explanation | str]) -> Explanation | str:
    if isinstance(results[0], str):  # the models share the featurizer: one reason for all
        return results[0]
    predictions = np.array([r.prediction for r in results])
    return Explanation(np.mean([r.atoms for r in results], axis=0), float(np.mean([r.output for r in results])),
                       float(np.mean([r.baseline for r in results])), float(predictions.mean()),
                       float(predictions.std()))

"""The optimizer of every training run: AdamW param groups by kind of parameter
(:func:`parameter_groups`; the head's own learning rate: :func:`head_lr_groups`), AdamW with its
per-step schedule (:func:`adamw_with_schedule`), and the kernel flags a run keeps when another
run's checkpoint is loaded (:func:`set_optimizer_kernel`).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn

from graphormer_urpe.training.schedule import warmup_polynomial_decay

#: Kinds of parameter, one AdamW param group each (see :func:`parameter_groups`).
ParameterKind = Literal["weight", "embedding", "bias", "layernorm", "urpe_scale"]
PARAMETER_KINDS: tuple[str, ...] = ParameterKind.__args__


#: Normalisation layers: their scale and shift are the ``layernorm`` kind.
NORM_LAYERS = (torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.RMSNorm,
               torch.nn.modules.batchnorm._NormBase)  # batch and instance norms


def parameter_kind(module: torch.nn.Module, param: torch.nn.Parameter) -> str:
    """The kind of ``module``'s own parameter ``param``, by rule, so a new module gets one too (a
    module may declare its ``weight_decay_kind``: URPE's C tables, learned tokens)."""
    declared = getattr(module, "weight_decay_kind", None)
    if declared is not None:
        return declared
    if isinstance(module, NORM_LAYERS):
        return "layernorm"
    if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
        return "embedding"
    return "bias" if param.dim() <= 1 else "weight"


def parameter_groups(model: torch.nn.Module, weight_decay: float,
                     no_weight_decay: Sequence[str] = ()) -> list[dict[str, Any]]:
    """AdamW param groups, one per :data:`ParameterKind` present, named by the kind, each decaying
    by ``weight_decay`` unless listed in ``no_weight_decay``. As in Graphormer's recipe every
    parameter decays; C is stored as ``C - 1``, so decay pulls it toward 1, its neutral value
    (``docs/model.md``)."""
    unknown = sorted(set(no_weight_decay) - set(PARAMETER_KINDS))
    if unknown:
        raise ValueError(f"unknown parameter kinds {unknown} in no_weight_decay; "
                         f"choose from {list(PARAMETER_KINDS)}")
    params: dict[str, list[torch.nn.Parameter]] = {kind: [] for kind in PARAMETER_KINDS}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if param.requires_grad:
                params[parameter_kind(module, param)].append(param)
    return [{"params": group, "name": kind,
             "weight_decay": 0.0 if kind in no_weight_decay else weight_decay}
            for kind, group in params.items() if group]


def head_lr_groups(groups: list[dict[str, Any]], head: nn.Module, head_lr: float | None) -> list[dict[str, Any]]:
    """``groups`` (AdamW param groups) with the head's parameters moved into groups of their own
    (``head/<kind>``) whose peak learning rate is ``head_lr``; unchanged for ``None``."""
    if head_lr is None:
        return groups
    if not head_lr > 0:
        raise ValueError(f"model.head_lr must be > 0, got {head_lr}")
    head_ids = {id(p) for p in head.parameters()}
    out = []
    for group in groups:
        body = [p for p in group["params"] if id(p) not in head_ids]
        own = [p for p in group["params"] if id(p) in head_ids]
        if body:
            out.append({**group, "params": body})
        if own:
            out.append({**group, "params": own, "lr": head_lr, "name": f"head/{group['name']}"})
    return out


def adamw_with_schedule(groups: list[dict[str, Any]], hp: Mapping[str, Any], warmup_steps: int,
                        total_steps: int, fused: bool, capturable: bool = False
                        ) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over ``groups`` with the module's hyperparameters ``hp`` (``lr``, ``betas``,
    ``eps``, ``weight_decay``, ``end_lr``, ``power``), and its per-step schedule."""
    optimizer = torch.optim.AdamW(groups, lr=hp["lr"], betas=tuple(hp["betas"]), eps=hp["eps"],
                                  weight_decay=hp["weight_decay"], fused=fused, capturable=capturable)
    scheduler = warmup_polynomial_decay(optimizer, warmup_steps, total_steps, hp["end_lr"], hp["power"])
    return optimizer, scheduler


def set_optimizer_kernel(optimizer: torch.optim.Optimizer) -> None:
    """Give every param group of ``optimizer`` (an Adam-family optimizer whose state may come from
    a checkpoint) the ``fused``, ``capturable`` and ``foreach`` flags it was built with (its ``defaults``, which
    loading leaves alone), and each step counter the device these want (the parameter's for
    either, else the CPU). ``Optimizer.load_state_dict`` restores the flags a checkpoint was saved
    with: an eager run's checkpoint resumed by the training engine would otherwise keep the unfused
    kernel (which refuses the engine's ``found_inf``), and a GPU engine's checkpoint resumed on a
    CPU the capturable one."""
    kernel = {flag: optimizer.defaults[flag] for flag in ("fused", "capturable", "foreach")}
    for group in optimizer.param_groups:
        group.update(kernel)
    fused, capturable = kernel["fused"], kernel["capturable"]
    on_device = bool(fused or capturable)
    for param, state in optimizer.state.items():
        step = state.get("step")
        if isinstance(step, Tensor):
            state["step"] = step.to(param.device if on_device else "cpu")

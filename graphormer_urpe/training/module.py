"""The thin LightningModule around the :class:`~graphormer_urpe.nn.graphormer.Graphormer` backbone.

Everything about the network lives in the backbone and its presets; this module adds the loss,
the metrics, AdamW and Graphormer's warmup + polynomial-decay schedule. Its init arguments are
plain values, so a checkpoint rebuilds the model without the config that trained it.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor
from torchmetrics import MeanAbsoluteError, Metric, MetricCollection
from torchmetrics.classification import BinaryAUROC, MulticlassAccuracy, MultilabelAUROC

from graphormer_urpe.data.batch import GraphBatch
from graphormer_urpe.nn.encodings import EdgePathBias, GraphToken, URPEScale, VirtualDistanceBias
from graphormer_urpe.nn.graphormer import Graphormer, GraphormerConfig
from graphormer_urpe.training.inference import TASKS, build_backbone, task_predictions
from graphormer_urpe.training.schedule import warmup_polynomial_decay

log = logging.getLogger(__name__)

#: ``regression``: L1 loss, MAE. ``classification``: binary or multi-label 0/1 targets, one
#: logit each, BCE, ROC-AUC. ``multiclass``: one integer class per graph, ``num_targets``
#: logits, cross-entropy, accuracy.
Task = Literal["regression", "classification", "multiclass"]
#: The validation metric of each task (logged as ``val/<name>``) and whether higher is better;
#: the CLI's checkpoint callback monitors it.
TASK_METRICS: dict[str, tuple[str, str]] = {
    "regression": ("mae", "min"), "classification": ("auroc", "max"),
    "multiclass": ("accuracy", "max")}
assert tuple(TASK_METRICS) == TASKS
#: Kinds of parameter, one AdamW param group each (see :func:`parameter_groups`).
ParameterKind = Literal["weight", "embedding", "bias", "layernorm", "urpe_scale"]
PARAMETER_KINDS: tuple[str, ...] = ParameterKind.__args__


def parameter_kind(module: torch.nn.Module, name: str) -> str:
    """The kind of ``module``'s own parameter ``name``: ``weight`` (linear maps, the edge
    encoding's per-hop matrices), ``embedding`` (lookup tables and learned tokens: atom, degree,
    bond, spatial bias, graph token, virtual distance), ``bias`` (linear biases), ``layernorm``
    (LayerNorm scale and shift) or ``urpe_scale`` (URPE's ``delta = C - 1``)."""
    if isinstance(module, URPEScale):
        return "urpe_scale"
    if isinstance(module, torch.nn.LayerNorm):
        return "layernorm"
    if isinstance(module, (torch.nn.Embedding, GraphToken, VirtualDistanceBias)):
        return "embedding"
    if isinstance(module, torch.nn.Linear) and name == "bias":
        return "bias"
    if isinstance(module, (torch.nn.Linear, EdgePathBias)):
        return "weight"
    raise TypeError(f"no weight-decay kind for parameter {name!r} of {type(module).__name__}; "
                    "add its module to parameter_kind")


def parameter_groups(model: torch.nn.Module, weight_decay: float,
                     no_weight_decay: Sequence[str] = ()) -> list[dict[str, Any]]:
    """AdamW param groups, one per :data:`ParameterKind` present, named by the kind (the
    ``lr-AdamW/<kind>`` curves of the learning-rate monitor).

    Every kind decays by ``weight_decay`` unless listed in ``no_weight_decay``. The default
    follows Graphormer's fairseq recipe, which decays every parameter (LayerNorm, biases and
    embeddings included), with one change that keeps decay neutral: C is stored as
    ``delta = C - 1`` (:class:`~graphormer_urpe.nn.encodings.URPEScale`), so decay pulls C
    toward 1 (no rescaling) rather than toward 0. Embeddings and biases decay toward 0, their
    neutral value. See ``docs/model.md``.
    """
    unknown = sorted(set(no_weight_decay) - set(PARAMETER_KINDS))
    if unknown:
        raise ValueError(f"unknown parameter kinds {unknown} in no_weight_decay; "
                         f"choose from {list(PARAMETER_KINDS)}")
    params: dict[str, list[torch.nn.Parameter]] = {kind: [] for kind in PARAMETER_KINDS}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if param.requires_grad:
                params[parameter_kind(module, name)].append(param)
    return [{"params": group, "name": kind,
             "weight_decay": 0.0 if kind in no_weight_decay else weight_decay}
            for kind, group in params.items() if group]


def compile_backbone(model: Graphormer) -> None:
    """``torch.compile(dynamic=True)`` each encoder layer and the edge-path encoding, in place.

    Regions rather than the whole forward: the encoder layers share their code, so one compiled
    graph serves all of them and a cold start compiles ~3x faster (slim on CPU: 45 s instead of
    ~135 s); the batch checks and the cheap embedding lookups stay eager. ``dynamic=True``:
    batches vary in ``N``, ``E`` and ``B``, so shapes are symbolic from the first call instead of
    recompiling per size. ``nn.Module.compile`` keeps parameter names, so checkpoints are the same
    with and without compilation.
    """
    for layer in model.layers:
        layer.compile(dynamic=True)
    if getattr(model, "edge_bias", None) is not None:  # "urpe" / "rpe" only
        model.edge_bias.compile(dynamic=True)


def task_metric(task: str, num_targets: int) -> Metric:
    """The validation / test metric of ``task`` (:data:`TASK_METRICS`); label ``-1`` = unknown."""
    if task == "regression":
        return MeanAbsoluteError()
    if task == "multiclass":
        return MulticlassAccuracy(num_classes=num_targets, average="micro", ignore_index=-1)
    if num_targets == 1:
        return BinaryAUROC(ignore_index=-1)
    return MultilabelAUROC(num_labels=num_targets, ignore_index=-1)


class GraphormerModule(pl.LightningModule):
    """Graph-level regression (L1 loss, MAE), binary / multi-label classification (BCE,
    ROC-AUC) or multi-class classification (cross-entropy, accuracy); see :data:`Task`.

    Args:
        num_atom_embeddings, num_bond_embeddings, num_targets, max_hops, task, featurizer:
            facts of the data; the CLI links them from the DataModule. ``featurizer`` names how
            SMILES become graphs (``zinc`` or ``ogb``), so inference can redo it from the
            checkpoint alone.
            For ``multiclass``, ``num_targets`` is the number of classes.
        preset: backbone preset, a name in :data:`~graphormer_urpe.nn.graphormer.PRESETS`
            (``slim`` for ZINC, ``small`` / ``base`` for PCQM4Mv2).
        backbone: the fields of the preset to replace (:class:`GraphormerConfig`, e.g.
            ``attention: rpe``); unset fields keep the preset's value. The checkpoint stores the
            complete resolved backbone, so it rebuilds the same model even if a preset changes.
        lr, end_lr, warmup_steps, total_steps, power: Graphormer's schedule. ``total_steps``
            None: the trainer's step budget (``trainer.max_steps``, or epochs x batches).
        weight_decay, betas, eps: AdamW.
        no_weight_decay: parameter kinds exempt from weight decay (:data:`ParameterKind`);
            by default every kind decays, as in Graphormer (:func:`parameter_groups`).
        compile: compile the backbone with ``torch.compile(dynamic=True)``, region by region
            (:func:`compile_backbone`).
        target_names: the targets' names (the CSV DataModule's ``target_columns``), recorded so
            predictions can be labelled from the checkpoint alone; ``None`` = unnamed.
    """

    def __init__(
        self,
        num_atom_embeddings: int,
        num_bond_embeddings: int,
        num_targets: int = 1,
        max_hops: int = 5,
        task: Task = "regression",
        featurizer: str = "zinc",
        preset: str = "slim",
        backbone: GraphormerConfig = GraphormerConfig(),
        lr: float = 2e-4,
        end_lr: float = 1e-9,
        warmup_steps: int = 60_000,
        total_steps: int | None = None,
        power: float = 1.0,
        weight_decay: float = 0.01,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        no_weight_decay: list[ParameterKind] | None = None,
        compile: bool = False,
        target_names: list[str] | None = None,
    ) -> None:
        super().__init__()
        self.model, resolved = build_backbone(num_atom_embeddings, num_bond_embeddings, num_targets,
                                              max_hops, task, preset, backbone)
        self.save_hyperparameters(ignore=["backbone"])
        # Plain values only (checkpoints load with weights_only=True), and complete.
        self.hparams["backbone"] = resolved.as_dict()
        if compile:
            compile_backbone(self.model)
        self.task = task
        metric_name = TASK_METRICS[task][0]
        for stage in ("val", "test"):
            setattr(self, f"{stage}_metrics", MetricCollection(
                {metric_name: task_metric(task, num_targets)}, prefix=f"{stage}/"))

    def forward(self, batch: GraphBatch) -> Tensor:
        """Raw model outputs ``[B, num_targets]`` (logits for classification)."""
        return self.model(batch)

    def _loss(self, pred: Tensor, y: Tensor) -> Tensor:
        known = ~torch.isnan(y)  # PCQM4Mv2 test sets and multi-task CSVs have missing labels
        if self.task == "regression":
            return F.l1_loss(pred[known].float(), y[known])
        if self.task == "multiclass":
            known = known[:, 0]
            return F.cross_entropy(pred[known].float(), y[known, 0].long())
        return F.binary_cross_entropy_with_logits(pred[known].float(), y[known])

    def training_step(self, batch: GraphBatch, batch_idx: int) -> Tensor:
        loss = self._loss(self(batch), batch.y)
        if not torch.isfinite(loss):
            # Stop before the optimizer applies it; Lightning saves no checkpoint of this step.
            raise FloatingPointError(
                f"training loss is {loss.item()} at step {self.global_step} (epoch "
                f"{self.current_epoch}, batch {batch_idx}): check the targets for huge values "
                "and lower the learning rate; the last good checkpoint is untouched")
        self.log("train/loss", loss, prog_bar=True, batch_size=batch.num_graphs)
        return loss

    def on_train_epoch_start(self) -> None:
        # The training order is a function of (seed, epoch). Lightning's own set_epoch call passes
        # its count of processed epochs, which runs one ahead after resuming from an end-of-epoch
        # checkpoint; the epoch number itself keeps a resumed run on the uninterrupted run's order.
        sampler = getattr(self.trainer.train_dataloader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self.current_epoch)

    def _evaluate(self, batch: GraphBatch, stage: str) -> None:
        pred = self(batch).float()
        known = ~torch.isnan(batch.y)
        metrics = getattr(self, f"{stage}_metrics")
        if self.task == "regression":
            metrics.update(pred[known], batch.y[known])
        elif self.task == "multiclass":
            metrics.update(pred, torch.where(known[:, 0], batch.y[:, 0], -1).long())
        else:
            labels = torch.where(known, batch.y, -1).long()
            metrics.update(*((torch.sigmoid(pred), labels) if pred.shape[1] > 1
                             else (torch.sigmoid(pred[:, 0]), labels[:, 0])))
        self.log(f"{stage}/loss", self._loss(pred, batch.y), batch_size=batch.num_graphs,
                 sync_dist=True)
        self.log_dict(metrics, batch_size=batch.num_graphs, prog_bar=True)

    def validation_step(self, batch: GraphBatch, batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: GraphBatch, batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def predict_step(self, batch: GraphBatch, batch_idx: int) -> dict[str, Tensor]:
        """Predictions ``[B, num_targets]``: values, probabilities per label
        (``classification``) or per class (``multiclass``)."""
        return {"index": batch.index, "prediction": task_predictions(self.task, self(batch))}

    def schedule_steps(self) -> int:
        """``total_steps`` of the schedule: the given one, else the trainer's step budget; warns
        when the two disagree (the lr would not reach ``end_lr``, or stay there for long)."""
        given = self.hparams.total_steps
        trainer = self._trainer
        budget = trainer.estimated_stepping_batches if trainer is not None else math.inf
        if given is None:
            if not math.isfinite(budget):
                raise ValueError("the schedule needs a length: set model.total_steps or "
                                 "trainer.max_steps (or trainer.max_epochs)")
            return int(budget)
        if math.isfinite(budget) and int(budget) != given:
            log.warning("the learning-rate schedule decays over model.total_steps=%d but the "
                        "trainer stops after %d steps (trainer.max_steps / max_epochs); leave "
                        "total_steps unset to follow the trainer", given, int(budget))
        return given

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        groups = parameter_groups(self, hp.weight_decay, hp.get("no_weight_decay") or ())
        # Lightning refuses gradient clipping under mixed precision with a fused optimizer (it
        # would unscale inside its kernel), so the fused AdamW serves full-precision runs only.
        mixed = self._trainer is not None and "mixed" in str(self._trainer.precision)
        optimizer = torch.optim.AdamW(groups, lr=hp.lr, betas=tuple(hp.betas), eps=hp.eps,
                                      weight_decay=hp.weight_decay,
                                      fused=self.device.type == "cuda" and not mixed)
        total_steps = self.schedule_steps()
        if total_steps <= hp.warmup_steps:
            raise ValueError(f"warmup_steps ({hp.warmup_steps}) must be below the schedule's "
                             f"total steps ({total_steps}"
                             f"{'' if hp.total_steps else ', from the trainer'}): lower "
                             "model.warmup_steps")
        scheduler = warmup_polynomial_decay(optimizer, hp.warmup_steps, total_steps, hp.end_lr,
                                            hp.power)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}

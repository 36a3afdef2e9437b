"""The thin LightningModule around the :class:`~graphormer_urpe.nn.graphormer.Graphormer` backbone.

Everything about the network lives in the backbone and its presets; this module adds the loss,
the metrics, AdamW and Graphormer's warmup + polynomial-decay schedule. Its init arguments are
plain values, so a checkpoint rebuilds the model without the config that trained it.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor
from torchmetrics import MeanAbsoluteError, MetricCollection
from torchmetrics.classification import MultilabelAUROC

from graphormer_urpe.data.batch import GraphBatch
from graphormer_urpe.nn.encodings import EdgePathBias, GraphToken, URPEScale, VirtualDistanceBias
from graphormer_urpe.nn.graphormer import Graphormer
from graphormer_urpe.training.schedule import warmup_polynomial_decay

Task = Literal["regression", "classification"]
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


class GraphormerModule(pl.LightningModule):
    """Graph-level regression (L1 loss, MAE) or binary classification (BCE, ROC-AUC).

    Args:
        num_atom_embeddings, num_bond_embeddings, num_targets, max_hops, task, featurizer:
            facts of the data; the CLI links them from the DataModule. ``featurizer`` names how
            SMILES become graphs (``zinc`` or ``ogb``), so inference can redo it from the
            checkpoint alone.
        preset: backbone preset (``slim`` for ZINC, ``base`` for PCQM4Mv2).
        backbone: overrides of the preset's backbone arguments (e.g. ``attention: rpe``).
        lr, end_lr, warmup_steps, total_steps, power: Graphormer's schedule.
        weight_decay, betas, eps: AdamW.
        no_weight_decay: parameter kinds exempt from weight decay (:data:`ParameterKind`);
            by default every kind decays, as in Graphormer (:func:`parameter_groups`).
        compile: compile the backbone with ``torch.compile(dynamic=True)``, region by region
            (:func:`compile_backbone`).
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
        backbone: dict[str, Any] | None = None,
        lr: float = 2e-4,
        end_lr: float = 1e-9,
        warmup_steps: int = 60_000,
        total_steps: int = 400_000,
        power: float = 1.0,
        weight_decay: float = 0.01,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        no_weight_decay: list[ParameterKind] | None = None,
        compile: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = Graphormer.from_preset(
            preset,
            num_atom_embeddings=num_atom_embeddings,
            num_bond_embeddings=num_bond_embeddings,
            num_targets=num_targets,
            max_hops=max_hops,
            **(backbone or {}),
        )
        if compile:
            compile_backbone(self.model)
        self.task = task
        metric_name = "mae" if task == "regression" else "auroc"
        for stage in ("val", "test"):
            metric = (MeanAbsoluteError() if task == "regression"
                      else MultilabelAUROC(num_labels=num_targets, ignore_index=-1))
            setattr(self, f"{stage}_metrics", MetricCollection({metric_name: metric},
                                                               prefix=f"{stage}/"))

    def forward(self, batch: GraphBatch) -> Tensor:
        """Raw model outputs ``[B, num_targets]`` (logits for classification)."""
        return self.model(batch)

    def _loss(self, pred: Tensor, y: Tensor) -> Tensor:
        known = ~torch.isnan(y)  # PCQM4Mv2 test sets and multi-task CSVs have missing labels
        if self.task == "regression":
            return F.l1_loss(pred[known].float(), y[known])
        return F.binary_cross_entropy_with_logits(pred[known].float(), y[known])

    def training_step(self, batch: GraphBatch, batch_idx: int) -> Tensor:
        loss = self._loss(self(batch), batch.y)
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
        else:
            metrics.update(torch.sigmoid(pred), torch.where(known, batch.y, -1).long())
        self.log(f"{stage}/loss", self._loss(pred, batch.y), batch_size=batch.num_graphs,
                 sync_dist=True)
        self.log_dict(metrics, batch_size=batch.num_graphs, prog_bar=True)

    def validation_step(self, batch: GraphBatch, batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: GraphBatch, batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def predict_step(self, batch: GraphBatch, batch_idx: int) -> dict[str, Tensor]:
        pred = self(batch).float()
        if self.task == "classification":
            pred = torch.sigmoid(pred)
        return {"index": batch.index, "prediction": pred}

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        groups = parameter_groups(self, hp.weight_decay, hp.get("no_weight_decay") or ())
        optimizer = torch.optim.AdamW(groups, lr=hp.lr, betas=tuple(hp.betas), eps=hp.eps,
                                      weight_decay=hp.weight_decay,
                                      fused=self.device.type == "cuda")
        scheduler = warmup_polynomial_decay(optimizer, hp.warmup_steps, hp.total_steps,
                                            hp.end_lr, hp.power)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}

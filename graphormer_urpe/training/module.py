"""The thin LightningModule around the :class:`~graphormer_urpe.nn.graphormer.Graphormer` backbone.

Everything about the network lives in the backbone and its presets; this module adds the loss,
the metrics, AdamW and Graphormer's warmup + polynomial-decay schedule. Its init arguments are
plain values, so a checkpoint rebuilds the model without the config that trained it.
"""
from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor
from torchmetrics import MeanAbsoluteError, MetricCollection
from torchmetrics.classification import MultilabelAUROC

from graphormer_urpe.data.batch import GraphBatch
from graphormer_urpe.nn.graphormer import Graphormer
from graphormer_urpe.training.schedule import warmup_polynomial_decay

Task = Literal["regression", "classification"]


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
        backbone: dict[str, Any] | None = None,
        lr: float = 2e-4,
        end_lr: float = 1e-9,
        warmup_steps: int = 60_000,
        total_steps: int = 400_000,
        power: float = 1.0,
        weight_decay: float = 0.01,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        compile: bool = False,
        target_names: list[str] | None = None,
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
        optimizer = torch.optim.AdamW(self.parameters(), lr=hp.lr, betas=tuple(hp.betas),
                                      eps=hp.eps, weight_decay=hp.weight_decay,
                                      fused=self.device.type == "cuda")
        scheduler = warmup_polynomial_decay(optimizer, hp.warmup_steps, hp.total_steps,
                                            hp.end_lr, hp.power)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}

"""The LightningModule around the :class:`~graphormer_urpe.nn.graphormer.Graphormer` backbone.

Everything about the network lives in the backbone and its presets; this module adds the loss,
the metrics, AdamW and Graphormer's warmup + polynomial-decay schedule, the one training step
(:class:`~graphormer_urpe.training.engine.TrainingEngine`, with ``compile`` and fine-tuning's
frozen steps) and what a checkpoint keeps (RNG states, the checks of a resumed one). Its init arguments are plain values,
so a checkpoint rebuilds the model without the config that trained it.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from torch import Tensor
from torchmetrics import MeanMetric, MetricCollection

from graphormer_urpe.data.batch import GraphBatch
from graphormer_urpe.data.facts import DataFacts, check_checkpoint_encodings
from graphormer_urpe.data.resident import ResidentLoader
from graphormer_urpe.nn.graphormer import Graphormer, GraphormerConfig
from graphormer_urpe.training import finetune
from graphormer_urpe.training.run_checkpoint import rng_states, set_rng_states
from graphormer_urpe.training.engine import StepSpec, TrainingEngine
from graphormer_urpe.nn.graphormer import build_backbone
from graphormer_urpe.utils.lightning_private import trainer_of
from graphormer_urpe.training.optim import (ParameterKind, adamw_with_schedule, head_lr_groups,
                                           parameter_groups, set_optimizer_kernel)
from graphormer_urpe.training.schedule import schedule_lengths
from graphormer_urpe.data.task import get_task

log = logging.getLogger(__name__)
#: Checkpoint keys: the global random states (every process's, in rank order, in a multi-process
#: run), the lr schedule trained with, fp16's loss scale, the unit of the place in the epoch
#: (:func:`data_position`), the accumulation cycle in progress (absent at a cycle's end).
RNG_STATES, PROCESS_RNG_STATES, LR_SCHEDULE = "rng_states", "process_rng_states", "lr_schedule"
LOSS_SCALE, DATA_POSITION, ACCUMULATED = "loss_scale", "data_position", "accumulated_gradients"


def data_position(trainer: pl.Trainer, datamodule: Any) -> dict[str, int]:
    """The unit of a checkpoint's count of batches done in its epoch: graphs per optimizer step
    (``global_batch``) and batches per step (``accumulate``); a run resumed inside an epoch
    continues at the same graph only with the same two."""
    batch_size = int(getattr(datamodule, "batch_size", 0) or 0)
    accumulate = int(trainer.accumulate_grad_batches)
    return {"global_batch": trainer.world_size * batch_size * accumulate, "accumulate": accumulate}


def accumulated_share(states: list[dict], rank: int, world_size: int) -> dict:
    """Process ``rank``'s part of the accumulation cycle that a checkpoint's processes (``states``,
    in rank order) had summed: its own on as many processes; on another number (the same global
    batch), the first process continues the sum of all of them (the same update, up to the order
    of a float sum), the others their own new sums."""
    if len(states) == world_size:
        return states[rank]
    if rank > 0:
        first = states[0]
        return {"gradients": [None] * len(first["gradients"]), "loss_total": torch.zeros_like(first["loss_total"]),
                "weights": torch.zeros_like(first["weights"])}
    gradients = []
    for grads in zip(*(state["gradients"] for state in states)):
        present = [grad for grad in grads if grad is not None]
        gradients.append(torch.stack(present).sum(0) if present else None)
    return {"gradients": gradients, "loss_total": sum(state["loss_total"] for state in states),
            "weights": sum(state["weights"] for state in states)}


def process_seed(seed: int, rank: int) -> int:
    """The torch seed of process ``rank`` of a run seeded with ``seed`` (rank 0 keeps it)."""
    return (seed + rank * 0x9E3779B97F4A7C15) % 2**63

def compile_backbone(model: Graphormer, dynamic: bool = True) -> None:
    """``torch.compile(dynamic=dynamic)`` each encoder layer and the edge-path encoding, in place:
    one compiled graph serves every layer, so a cold start compiles several times faster than the
    whole forward (docs/benchmarks.md); ``dynamic``: batches vary in size; parameter names, hence
    checkpoints, stay as they are."""
    for layer in model.layers:
        layer.compile(dynamic=dynamic)
    if getattr(model, "edge_bias", None) is not None:  # "urpe" / "rpe" only
        model.edge_bias.compile(dynamic=dynamic)


class OwnStepHooks:
    """LightningModule hooks for a ``training_step`` that takes the whole optimizer step itself
    (``self._engine``, a :class:`~.engine.TrainingEngine`) while Lightning's automatic
    optimization counts it (``global_step``, the schedule, checkpoints and resume): its
    optimizer-step hook only runs the closure, its zero-grad and backward hooks do nothing."""

    _engine: TrainingEngine

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        # Lightning calls the closure outside this hook for a batch that only accumulates gradients.
        self._engine.updating = True
        try:
            optimizer_closure()
        finally:
            self._engine.updating = False

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer) -> None:
        pass

    def backward(self, loss: Tensor, *args, **kwargs) -> None:
        pass

    def configure_callbacks(self):
        return [*super().configure_callbacks(), self._engine]


class GraphormerModule(OwnStepHooks, pl.LightningModule):
    """Graph-level regression (L1 loss, MAE), binary / multi-label classification (BCE,
    ROC-AUC) or multi-class classification (cross-entropy, accuracy), as the data's
    ``facts.task`` says: a :class:`~graphormer_urpe.data.task.Task` each.

    Args:
        facts: the facts of the data (:class:`~graphormer_urpe.data.facts.DataFacts`, or its
            plain dict as a checkpoint records it): vocabulary sizes, task, number of targets,
            encoding parameters, featurizer. The CLI links it from the DataModule.
        preset: backbone preset, a name in :data:`~graphormer_urpe.nn.graphormer.PRESETS`
            (``slim`` for ZINC, ``small`` / ``base`` for PCQM4Mv2).
        backbone: the fields of the preset to replace (:class:`GraphormerConfig`, e.g.
            ``attention: rpe``); unset fields keep the preset's value. The checkpoint stores the
            complete resolved backbone, so it rebuilds the same model even if a preset changes.
        lr, end_lr, total_steps, power: Graphormer's schedule. ``total_steps``
            None: the trainer's step budget (``trainer.max_steps``, or epochs x batches).
        warmup_steps: optimizer steps of linear warmup; ignored where ``warmup_fraction`` is set
            (which then applies).
        weight_decay, betas, eps: AdamW.
        no_weight_decay: parameter kinds exempt from weight decay (:data:`ParameterKind`);
            by default every kind decays, as in Graphormer (:func:`parameter_groups`).
        compile: compile the backbone with ``torch.compile(dynamic=True)``, region by region
            (:func:`compile_backbone`).
        matmul_precision: ``torch.set_float32_matmul_precision`` at setup (``high``: TF32 matmuls
            on GPUs that have them); ``None`` leaves the process setting alone.
        target_names: the targets' names (the CSV DataModule's ``target_columns``), recorded so
            predictions can be labelled from the checkpoint alone; ``None`` = unnamed.
        init_from: fine-tuning: a checkpoint of this project (training or weights-only) whose
            backbone weights replace the initial ones when ``fit`` starts (not when it resumes
            with ``--ckpt_path``); every parameter must fit, else the run stops naming each
            misfit with both shapes (:mod:`~graphormer_urpe.training.finetune`).
        reinit_head: keep the new, randomly initialised output head even where the
            checkpoint's would fit (it is always re-initialised when the task or the number of
            targets differs).
        freeze_backbone_steps: train only the output head for this many first optimizer steps.
        freeze_layers: keep the first this many encoder layers, and the input encoders and
            attention biases below them, as ``init_from`` loaded them for the whole fit: the
            backward pass stops at the first trained layer, so a step costs less. Without
            ``init_from`` (from scratch) every layer trains.
        head_lr: peak learning rate of the output head (its own AdamW param groups, same
            schedule); ``None``: ``lr``.
        warmup_fraction: warmup as a fraction of the schedule's total steps; when set, it
            applies and ``warmup_steps`` is ignored (short fine-tuning runs whose length follows
            ``max_epochs``).
        loss: regression only: ``l1`` (default) or ``mse`` (squared error, for a target judged
            by RMSE); checkpoints are still selected by validation MAE.
    """

    def __init__(
        self,
        facts: DataFacts,
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
        matmul_precision: Literal["highest", "high", "medium"] | None = None,
        init_from: str | None = None,
        reinit_head: bool = False,
        freeze_backbone_steps: int = 0,
        freeze_layers: int = 0,
        head_lr: float | None = None,
        warmup_fraction: float | None = None,
        loss: Literal["l1", "mse"] | None = None,
    ) -> None:
        super().__init__()
        # before any data is read; a warmup fraction of a length not yet known counts as none
        schedule_lengths(lr, end_lr, warmup_steps, warmup_fraction, total_steps)
        self.save_hyperparameters(ignore=["backbone"])
        self.facts = DataFacts.coerce(facts)
        self.model, resolved = build_backbone(self.facts, preset, backbone)
        #: The layers kept as loaded: none from scratch, where nothing was loaded.
        self._frozen_layers = freeze_layers if init_from else 0
        if freeze_layers < 0 or self._frozen_layers > resolved.num_layers:
            raise ValueError(f"model.freeze_layers {freeze_layers}: give 0 to {resolved.num_layers}, "
                             "the backbone's number of layers")
        # Plain values only (checkpoints load with weights_only=True), and complete.
        self.hparams["facts"] = self.facts.as_dict()
        self.hparams["backbone"] = resolved.as_dict()
        if compile:
            compile_backbone(self.model)
        self._resumed_rng: dict[str, Any] | None = None  # from the checkpoint a fit resumes
        self._resumed_schedule: list | None = None  # the lr schedule of that checkpoint
        #: relative_lr's arguments after the update number, set by :meth:`configure_optimizers`.
        self.schedule: tuple[int, int, float, float] | None = None
        #: The one training step (:mod:`~graphormer_urpe.training.engine`).
        self._engine = TrainingEngine()
        self.task = get_task(self.facts.task).with_loss(loss)
        for stage in ("val", "test"):
            setattr(self, f"{stage}_metrics", MetricCollection(
                {self.task.metric_name: self.task.metric(self.facts.num_targets)}, prefix=f"{stage}/"))
            # The split's mean loss over its labelled targets: sums and counts, added across the
            # processes of a multi-process run (Lightning's own mean of a logged value truncates
            # the processes' counts to an integer mean on gloo). A NaN loss stays NaN (the
            # "disable" strategy would drop the weights).
            setattr(self, f"{stage}_loss", MeanMetric(nan_strategy=float("nan")))

    @property
    def hparams_initial(self):
        """The hyperparameters the loggers record (``hparams.yaml``) as the checkpoint holds them."""
        initial = super().hparams_initial
        initial.update({key: self.hparams[key] for key in ("facts", "backbone") if key in self.hparams})
        return initial

    def forward(self, batch: GraphBatch) -> Tensor:
        """Raw model outputs ``[B, num_targets]`` (logits for classification)."""
        return self.model(batch)

    def _loss(self, pred: Tensor, y: Tensor) -> Tensor:
        """Mean loss over the known labels (:meth:`Task.loss`)."""
        return self.task.loss(pred, y)

    def training_step(self, batch: GraphBatch, batch_idx: int) -> Tensor:
        return self._engine.training_step(batch, self.trainer, frozen=self.backbone_frozen())

    def step_spec(self) -> StepSpec:
        """What the training step takes from this module when training starts; the split to
        gather batches of one shape from where the loader is device-resident with ``static_shapes``."""
        loader = self.trainer.train_dataloader
        static = isinstance(loader, ResidentLoader) and loader.static_shapes
        return StepSpec(self.model, self.task.loss_terms, self.schedule, loader.split if static else None)

    def backbone_frozen(self) -> bool:
        return self.global_step < self.hparams.get("freeze_backbone_steps", 0)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        trainer = trainer_of(self)
        if trainer is not None:
            self._engine.check(trainer)  # a diverged run stops here, before its state is saved
        checkpoint[RNG_STATES] = rng_states()
        if trainer is not None and trainer.world_size > 1:  # every process's, in rank order
            states = [None] * trainer.world_size
            torch.distributed.all_gather_object(states, checkpoint[RNG_STATES])
            checkpoint[RNG_STATES], checkpoint[PROCESS_RNG_STATES] = states[0], states
        if trainer is not None:
            checkpoint[DATA_POSITION] = data_position(trainer, trainer.datamodule)
        if self.schedule is not None:
            checkpoint[LR_SCHEDULE] = list(self.schedule)
        if self._engine.loss_scale is not None:
            checkpoint[LOSS_SCALE] = self._engine.loss_scale.state_dict()
        accumulated = self._engine.accumulated()  # a validation inside an accumulation cycle
        if accumulated is not None:
            states = [accumulated]
            if trainer is not None and trainer.world_size > 1:
                states = [None] * trainer.world_size
                torch.distributed.all_gather_object(states, accumulated)
            checkpoint[ACCUMULATED] = states

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Before the weights load: there a model built for other encodings fails with a list of
        # parameter names instead of the data options to change.
        check_checkpoint_encodings(checkpoint.get("hyper_parameters", {}), self.facts)
        trainer = trainer_of(self)
        rank = trainer.global_rank if trainer is not None else 0
        processes = checkpoint.get(PROCESS_RNG_STATES) or [checkpoint.get(RNG_STATES)]
        # A process the checkpoint did not have (resumed on more) draws from its own seed.
        self._resumed_rng = processes[rank] if rank < len(processes) else None
        self._resumed_schedule = checkpoint.get(LR_SCHEDULE)
        self._engine.resumed_loss_scale = checkpoint.get(LOSS_SCALE)
        accumulated = checkpoint.get(ACCUMULATED)
        if accumulated:
            world_size = trainer.world_size if trainer is not None else 1
            self._engine.resumed_accumulation = accumulated_share(accumulated, rank, world_size)

    def on_train_start(self) -> None:
        # A checkpoint restores the optimizer's kernel flags of the run that saved it (eager or
        # the engine, CPU or GPU); this run's own choice applies.
        for optimizer in self.trainer.optimizers:
            set_optimizer_kernel(optimizer)
        # A resumed fit continues the saved random states (dropout), restored here: after the
        # sanity check and anything else set up draws, right before the first step (the loaders
        # draw from their own generators, not from these).
        if self._resumed_rng is not None:
            set_rng_states(self._resumed_rng)
            self._resumed_rng = None
        elif self.trainer.global_rank > 0:
            # Every process was seeded alike (the same initial weights); each draws its own
            # dropout masks from here on.
            torch.manual_seed(process_seed(torch.initial_seed(), self.trainer.global_rank))

    def setup(self, stage: str) -> None:
        if stage == "fit":
            problems = TrainingEngine.unsupported(self.trainer)
            if problems:
                raise ValueError("training needs " + "; ".join(problems))
        if self.hparams.get("matmul_precision"):
            torch.set_float32_matmul_precision(self.hparams.matmul_precision)

    def on_fit_start(self) -> None:
        # Here rather than in setup: a resumed fit has restored its checkpoint by now
        # (trainer.ckpt_path is set), and its weights, not init_from's, continue.
        if self.hparams.get("init_from") and self.trainer.ckpt_path is None:
            finetune.load_backbone(self, self.hparams.init_from, self.hparams.get("reinit_head", False))
        if self.model.num_descriptors and self.trainer.ckpt_path is None:
            # the training split's statistics, which every later prediction standardizes with
            self.model.head.set_statistics(self.trainer.datamodule.descriptor_statistics())

    def on_train_batch_start(self, batch: GraphBatch, batch_idx: int) -> None:
        finetune.set_trainable(self.model, self.backbone_frozen(), self._frozen_layers)

    def _evaluate(self, batch: GraphBatch, stage: str) -> None:
        pred = self(batch).float()
        if stage == "val":  # of the split's own items (not those that top up a process's share)
            self._nonfinite_outputs += (~torch.isfinite(pred) & (batch.index >= 0)[:, None]).sum()
        metrics, loss = getattr(self, f"{stage}_metrics"), getattr(self, f"{stage}_loss")
        self.task.update_metric(metrics[self.task.metric_name], pred, batch.y)
        loss.update(*self.task.loss_terms(pred, batch.y))  # weighted by its labelled targets
        self.log(f"{stage}/loss", loss, batch_size=batch.num_graphs)
        self.log_dict(metrics, batch_size=batch.num_graphs, prog_bar=True)

    def validation_step(self, batch: GraphBatch, batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def on_validation_epoch_start(self) -> None:
        self._nonfinite_outputs = torch.zeros((), dtype=torch.int64, device=self.device)

    def on_validation_epoch_end(self) -> None:
        # A model whose outputs are no longer finite (a learning rate far too high) is not
        # checkpointed as if it were the best: the fit stops here, before the checkpoints. The
        # outputs, not the metric: a ROC-AUC or an accuracy of NaN outputs is a number.
        if self.trainer.sanity_checking or self.trainer.state.fn != "fit":
            return
        nonfinite = int(self.trainer.strategy.reduce(self._nonfinite_outputs, reduce_op="sum"))
        if nonfinite:
            raise FloatingPointError(
                f"{nonfinite} validation outputs are not finite after step {self.global_step} (validation "
                f"{self.task.metric_name}: {float(self.val_metrics[self.task.metric_name].compute())}): no "
                "checkpoint of this model is kept; lower the learning rate and resume from the last "
                "checkpoint, or start again")

    def test_step(self, batch: GraphBatch, batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def predict_step(self, batch: GraphBatch, batch_idx: int) -> dict[str, Tensor]:
        """Predictions ``[B, num_targets]``: values, probabilities per label
        (``classification``) or per class (``multiclass``)."""
        return {"index": batch.index, "prediction": self.task.predictions(self(batch))}

    def schedule_lengths(self) -> tuple[int, int]:
        """``(warmup, total)`` of the schedule: the total given, else the trainer's step budget;
        warns when the two disagree."""
        hp, trainer = self.hparams, trainer_of(self)
        budget = trainer.estimated_stepping_batches if trainer is not None else math.inf
        warmup, total = schedule_lengths(hp.lr, hp.end_lr, hp.warmup_steps, hp.get("warmup_fraction"),
                                         hp.total_steps, budget)
        if total is None:
            raise ValueError("the schedule needs a length: set model.total_steps or "
                             "trainer.max_steps (or trainer.max_epochs)")
        if hp.total_steps is not None and math.isfinite(budget) and int(budget) != total:
            log.warning("the learning-rate schedule decays over model.total_steps=%d but the "
                        "trainer stops after %d steps (trainer.max_steps / max_epochs); leave "
                        "total_steps unset to follow the trainer", total, int(budget))
        return warmup, total

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        groups = head_lr_groups(parameter_groups(self, hp.weight_decay, hp.get("no_weight_decay") or ()),
                                self.model.head, hp.get("head_lr"))
        # The fused AdamW: its found_inf skips a step on the device; capturable on a GPU, where
        # the step is recorded in a CUDA graph.
        warmup_steps, total_steps = self.schedule_lengths()
        optimizer, scheduler = adamw_with_schedule(groups, hp, warmup_steps, total_steps, fused=True,
                                                   capturable=self.device.type == "cuda")
        #: relative_lr's arguments after the update number (the engine's on-device lr factor)
        self.schedule = (warmup_steps, total_steps, hp.end_lr / hp.lr, hp.power)
        # A resumed fit on another schedule (a larger trainer.max_steps without model.total_steps)
        # cannot end where one uninterrupted run would.
        saved = self._resumed_schedule
        if saved is not None and [float(v) for v in saved] != [float(v) for v in self.schedule]:
            log.warning("resuming with another learning-rate schedule (warmup %d, total %d steps) than "
                        "the checkpoint was trained with (warmup %d, total %d steps): the run will not "
                        "equal an uninterrupted one; give every fit of a resumed run the same "
                        "--model.total_steps", self.schedule[0], self.schedule[1], saved[0], saved[1])
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}


def load_training_module(ckpt, map_location: str = "cpu") -> GraphormerModule:
    """The :class:`GraphormerModule` of a checkpoint, in eval mode, checked as
    :func:`~graphormer_urpe.prediction.load.load_module` checks it."""
    from graphormer_urpe.prediction.load import load_module

    return load_module(ckpt, map_location, model_class=GraphormerModule)

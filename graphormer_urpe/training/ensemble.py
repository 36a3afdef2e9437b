r"""Several runs of one recipe trained side by side in one process, as one stacked model.

The ablation's grid (arms ``urpe`` / ``rpe`` x seeds) is ``M`` runs of the same Graphormer that
differ only in their seed and in whether C is learned. :class:`Ensemble` trains them as ONE
model whose every parameter has a leading member axis ``[M, ...]``
(:func:`torch.func.stack_module_state`) and whose step is the solo step under
:func:`torch.func.vmap` (``randomness="different"``: every member draws its own dropout masks):

.. math::
    \theta_m \leftarrow \mathrm{AdamW}\Big(\theta_m,\ g_m \min\big(1, \tfrac{c}{\lVert g_m
    \rVert_2 + 10^{-6}}\big),\ \eta(t)\Big), \qquad
    g_m = \nabla_{\theta_m} \mathcal{L}\big(f(\theta_m; X_m), y_m\big)

Each member keeps everything its solo run (``graphormer-urpe fit`` with the same arguments) has:

* its **initialisation**: the member's module is built by the training CLI with the member's own
  arguments (``seed_everything`` = its seed), then stacked;
* its **data order**: :class:`~graphormer_urpe.data.dataset.SeededShuffleSampler` with its seed,
  batch for batch (the last, smaller batch of an epoch is padded with target-less empty graphs,
  which the loss ignores);
* its **gradient clipping** (the total norm ``\lVert g_m \rVert`` of its own gradients), its
  **AdamW state** (AdamW is element-wise, so stacked moments are per-member moments) and weight
  decay, and the solo run's learning-rate schedule (:mod:`~graphormer_urpe.training.schedule`);
* its **checkpoints**: an ordinary ``GraphormerModule`` checkpoint per member (the best one by
  ``val/mae`` and ``last.ckpt``, with the ``ModelCheckpoint`` state a solo run's ``last.ckpt``
  carries) that ``graphormer-urpe test`` and ``graphormer-urpe-predict`` read.

An ``rpe`` member is stacked as URPE with ``C`` frozen at exactly 1: its ``delta = C - 1`` starts
at 0 and its gradient is masked to 0, so AdamW (moments 0, decay of 0) keeps it at 0 bit for bit,
and ``softmax(.) * 1`` is the RPE probabilities bit for bit. Its checkpoint is the plain
``attention: rpe`` model (no C), with the hyperparameters of its solo run.

Batches of all members are padded to one shape (:class:`~graphormer_urpe.data.batch.BatchPadding`
over the training split) and stacked to ``[M, ...]``; the step reads nothing back to the host, so
on a GPU it can be captured whole in one CUDA graph and replayed (``cuda_graph=True``). Losses are
read every ``log_every_n_steps``.

The whole ensemble (stacked parameters, AdamW and schedule state, RNG, epoch, step, each member's
best checkpoint) is saved to ``state.pt`` at the end of an epoch (at most every
``save_every_s`` seconds, and at every validation); a new :class:`Ensemble` over the same members
resumes from it exactly.
"""
from __future__ import annotations

import csv
import inspect
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch import Tensor
from torch.func import functional_call, stack_module_state, vmap

from graphormer_urpe.data.batch import BatchPadding, GraphBatch
from graphormer_urpe.data.dataset import SeededShuffleSampler
from graphormer_urpe.data.resident import ResidentSplit, TensorGraphs
from graphormer_urpe.files import atomic_write
from graphormer_urpe.nn.graphormer import Graphormer, attention_variant
from graphormer_urpe.checkpoint import read_checkpoint
from graphormer_urpe.training.inference import build_backbone
from graphormer_urpe.training.module import GraphormerModule, parameter_groups, set_optimizer_kernel
from graphormer_urpe.training.schedule import schedule_lengths, warmup_polynomial_decay

log = logging.getLogger(__name__)

STATE_FILE = "state.pt"
#: Module options of fine-tuning runs, which the stacked step does not implement.
FINE_TUNING_HPARAMS = ("init_from", "head_lr", "freeze_backbone_steps")
#: Eager steps (on a side stream) before the step is captured in a CUDA graph.
GRAPH_WARMUP_STEPS = 3
METRICS_FILE = Path("csv") / "ensemble" / "metrics.csv"
#: The columns of each member's :data:`METRICS_FILE`.
METRICS_COLUMNS = ("epoch", "step", "train/loss", "val/mae")
#: Trainer precisions the stacked step runs (autocast dtype or None).
PRECISIONS = {"32-true": None, "32": None, "bf16-mixed": torch.bfloat16}


@dataclass(frozen=True)
class MemberSpec:
    """One run of the ensemble: ``graphormer-urpe fit <cli_args>`` (which names its run
    directory with ``--trainer.default_root_dir``) and a label for messages."""

    label: str
    cli_args: tuple[str, ...]


@dataclass
class Member:
    """A member as its solo run builds it: the module, its DataModule and trainer settings, and
    its checkpoint callback (whose state its checkpoints carry)."""

    spec: MemberSpec
    module: GraphormerModule
    datamodule: Any
    trainer: pl.Trainer

    @property
    def run_dir(self) -> Path:
        return Path(self.trainer.default_root_dir)

    @property
    def checkpoint(self):
        return self.trainer.checkpoint_callback

    @property
    def frozen_scale(self) -> bool:
        """True for an ``rpe`` member: stacked as URPE with C frozen at 1."""
        return not attention_variant(self.module.hparams.backbone["attention"]).scale


def build_member(spec: MemberSpec) -> Member:
    """The member's module, DataModule and trainer exactly as ``graphormer-urpe fit`` builds
    them from its arguments (``seed_everything`` before the module, so the same weights)."""
    from graphormer_urpe.training.cli import build_cli

    cli = build_cli([*spec.cli_args, "--trainer.logger", "false"], run=False)
    return Member(spec, cli.model, cli.datamodule, cli.trainer)


def stack_batches(batches: Sequence[GraphBatch]) -> dict[str, Tensor]:
    """Member batches of one shape stacked field by field to ``[M, ...]`` (vmap's inputs)."""
    return {name: torch.stack([getattr(b, name) for b in batches])
            for name in batches[0].tensors()}


def _trainer_settings(trainer: pl.Trainer) -> dict[str, Any]:
    """The trainer options the ensemble follows; others that change training are refused."""
    unsupported = {
        "accumulate_grad_batches": trainer.accumulate_grad_batches != 1,
        "val_check_interval": trainer.val_check_interval not in (1, 1.0),
        "check_val_every_n_epoch": trainer.check_val_every_n_epoch is None,
        "gradient_clip_algorithm": trainer.gradient_clip_algorithm not in (None, "norm"),
        "precision": str(trainer.precision) not in PRECISIONS,
    }
    bad = [name for name, is_bad in unsupported.items() if is_bad]
    if bad:
        raise ValueError(f"--ensemble does not support these trainer settings: {bad} (it follows "
                         "max_steps, max_epochs, limit_train_batches, limit_val_batches, "
                         "check_val_every_n_epoch, gradient_clip_val, precision 32-true or "
                         "bf16-mixed, log_every_n_steps)")
    return {name: getattr(trainer, name) for name in (
        "max_steps", "max_epochs", "limit_train_batches", "limit_val_batches",
        "check_val_every_n_epoch", "gradient_clip_val", "precision", "log_every_n_steps")}


def _limit(num_batches: int, limit: int | float | None) -> int:
    """Lightning's ``limit_*_batches``: an int caps the count, a float is a fraction."""
    if limit is None:
        return num_batches
    if isinstance(limit, int) and not isinstance(limit, bool):
        return min(num_batches, limit)
    return num_batches if float(limit) == 1.0 else int(num_batches * float(limit))


class Ensemble:
    """The members of ``specs`` (same recipe, arms ``urpe`` / ``rpe``, any seeds) trained as one
    stacked model on ``device`` (default: the first member's trainer device), saving to
    ``state_dir`` (its :data:`STATE_FILE`) to resume: at the end of an epoch, at most every
    ``save_every_s`` seconds, and after every validation. ``progress`` receives the log lines;
    ``resident``: gather training batches from a device copy of the split (default: on a GPU).
    ``cuda_graph``: on a GPU, capture the whole optimizer step (forward, loss, backward, masks,
    clipping, AdamW with ``capturable=True`` and the learning rate as a device tensor) in one
    CUDA graph after :data:`GRAPH_WARMUP_STEPS` eager steps and replay it (ignored on a CPU)."""

    def __init__(self, specs: Sequence[MemberSpec], state_dir: Path | str,
                 device: torch.device | str | None = None, save_every_s: float = 600.0,
                 progress: Callable[[str], None] | None = None, resident: bool | None = None,
                 cuda_graph: bool = False) -> None:
        if not specs:
            raise ValueError("an ensemble needs at least one member")
        self.members = [build_member(spec) for spec in specs]
        self.state_dir = Path(state_dir)
        self.save_every_s = float(save_every_s)
        self.progress = progress or log.info
        first = self.members[0]
        self.settings = _trainer_settings(first.trainer)
        self._check_same_recipe()
        self.device = torch.device(device) if device is not None else first.trainer.strategy.root_device
        self.autocast_dtype = PRECISIONS[str(self.settings["precision"])]

        # One structure for all: URPE (per-layer C), eager attention, not compiled.
        hp = dict(first.module.hparams)
        backbone = {**hp["backbone"], "attention": "urpe", "share_urpe_scale": False}
        models = [self._as_urpe(member, backbone) for member in self.members]
        params, buffers = stack_module_state(models)
        self.params = {name: p.to(self.device).detach().requires_grad_() for name, p in params.items()}
        self.buffers = {name: b.to(self.device) for name, b in buffers.items()}
        init_args = inspect.signature(GraphormerModule).parameters  # not the CLI's _instantiator
        self.template = GraphormerModule(**{**{k: v for k, v in hp.items() if k in init_args},
                                            "backbone": backbone, "compile": False})
        self.template.to(self.device)
        if hp.get("matmul_precision"):
            torch.set_float32_matmul_precision(hp["matmul_precision"])
        # rpe members: gradient of every C entry masked to 0 (C stays exactly 1).
        keep = torch.tensor([0.0 if m.frozen_scale else 1.0 for m in self.members], device=self.device)
        self.grad_masks = {name: keep.view(-1, *[1] * (p.dim() - 1))
                           for name, p in self.params.items() if ".delta" in name}

        # Data: the training split once, each member's own sampler.
        dm = first.datamodule
        dm.prepare_data()
        dm.setup("fit")
        self.train_data = dm.train_dataset()
        # No per-batch host reads (vmap has none of the per-member values) nor embedding_bag
        # (no vmap rule): the split's ids are checked once here.
        self.template.model.make_capture_safe(self.train_data.graphs.x, self.train_data.graphs.edge_attr)
        self.batch_size = dm.batch_size
        # Every member's batch has one shape: the epoch's last, smaller batch gets empty graphs.
        self.padding = BatchPadding.covering(self.train_data.num_nodes, self.train_data.num_edges,
                                             self.batch_size, pad_graphs=True)
        self.train_data = self.train_data.padded(self.padding)
        # On a GPU the split lives there and batches are gathered there (data/resident.py); on
        # a CPU the numpy collation is the faster one. Both give the same batches.
        if resident is None:
            resident = self.device.type == "cuda"
        self.resident = (ResidentSplit(self.train_data, TensorGraphs.from_flat(self.train_data.graphs,
                                                                               self.device))
                         if resident else None)
        sizes = self.train_data.num_nodes if dm.bucket_batches else None
        self.samplers = [SeededShuffleSampler(len(self.train_data), m.datamodule.seed, self.batch_size,
                                              sizes=sizes, bucket_batches=dm.bucket_batches)
                         for m in self.members]
        full = (len(self.train_data) // self.batch_size if dm.static_shapes
                else math.ceil(len(self.train_data) / self.batch_size))
        self.batches_per_epoch = _limit(full, self.settings["limit_train_batches"])
        if self.batches_per_epoch < 1:
            raise ValueError(f"no training batch per epoch ({len(self.train_data)} graphs, batch size "
                             f"{self.batch_size}, limit_train_batches {self.settings['limit_train_batches']})")
        self.val_loader = dm.val_dataloader()
        val_graphs = dm.splits["val"].graphs
        self.template.model.check_ids(val_graphs.x, val_graphs.edge_attr)
        self.num_val_batches = _limit(len(self.val_loader), self.settings["limit_val_batches"])

        # AdamW over the stacked parameters, the kinds' groups of the solo run; its schedule.
        names = {id(p): name for name, p in self.template.model.named_parameters()}
        groups = [{**group, "params": [self.params[names[id(p)]] for p in group["params"]]}
                  for group in parameter_groups(self.template.model, hp["weight_decay"],
                                                hp.get("no_weight_decay") or ())]
        self.cuda_graph = bool(cuda_graph) and self.device.type == "cuda"
        # The schedule (the solo run's LambdaLR) steps a stand-in optimizer's float learning
        # rate; before every step it is copied into AdamW's groups, or, under a CUDA graph, into
        # the one device tensor they all read.
        self._lr = torch.tensor(float(hp["lr"]), device=self.device) if self.cuda_graph else None
        self.optimizer = torch.optim.AdamW(groups, lr=self._lr if self.cuda_graph else hp["lr"],
                                           betas=tuple(hp["betas"]), eps=hp["eps"],
                                           weight_decay=hp["weight_decay"],
                                           fused=True, capturable=self.cuda_graph)
        self._point_lr()
        warmup_steps, self.total_steps = schedule_lengths(hp["lr"], hp["end_lr"], hp["warmup_steps"],
                                                          hp.get("warmup_fraction"), hp["total_steps"],
                                                          self._step_budget())
        # The schedule rides on a stand-in optimizer (the members' AdamW reads its rate). It steps
        # once here, a no-op (its one tensor has no gradient), so torch's check for
        # "scheduler.step() before optimizer.step()" does not warn at the first step.
        stand_in = torch.optim.SGD([torch.zeros(1)], lr=hp["lr"])
        self.scheduler = warmup_polynomial_decay(stand_in, warmup_steps, self.total_steps,
                                                 hp["end_lr"], hp["power"])
        stand_in.step()
        self._graph: torch.cuda.CUDAGraph | None = None
        self._eager_steps = 0
        self.step, self.epoch = 0, 0
        self.best: list[tuple[str, float] | None] = [None] * len(self.members)
        self._train_step = vmap(self._member_loss, in_dims=(0, 0, 0), randomness="different")
        self._predict = vmap(self._member_predictions, in_dims=(0, 0, None), randomness="different")
        self._resume()

    # Building ------------------------------------------------------------------------------
    def _check_same_recipe(self) -> None:
        """Every member must be the same run up to its seed and arm."""
        def recipe(member: Member) -> dict:
            hp = dict(member.module.hparams)
            hp["backbone"] = {k: v for k, v in hp["backbone"].items()
                              if k not in ("attention", "share_urpe_scale")}
            return hp

        first = self.members[0]
        for member in self.members:
            backbone = member.module.hparams.backbone
            if not attention_variant(backbone["attention"]).bias or backbone.get("share_urpe_scale"):
                raise ValueError(f"{member.spec.label}: --ensemble trains the arms urpe and rpe "
                                 f"(attention {backbone['attention']!r}, share_urpe_scale "
                                 f"{backbone.get('share_urpe_scale')})")
            if backbone.get("attention_impl", "eager") != "eager":
                raise ValueError(f"{member.spec.label}: --ensemble needs attention_impl eager "
                                 f"(got {backbone['attention_impl']!r})")
            if member.module.task.name != "regression":
                raise ValueError(f"{member.spec.label}: --ensemble trains regression (val/mae)")
            fine_tuning = sorted(k for k in FINE_TUNING_HPARAMS if member.module.hparams.get(k))
            if fine_tuning:
                raise ValueError(f"{member.spec.label}: --ensemble trains from scratch, without "
                                 f"model.{', model.'.join(fine_tuning)}")
            if recipe(member) != recipe(first) or _trainer_settings(member.trainer) != self.settings:
                raise ValueError(f"{member.spec.label} differs from {first.spec.label} in more "
                                 "than the seed and the arm; an ensemble trains one recipe")

    @staticmethod
    def _as_urpe(member: Member, backbone: dict) -> Graphormer:
        """The member's weights in the stacked (URPE) structure; an rpe member gets C = 1."""
        hp = member.module.hparams
        model, _ = build_backbone(member.module.facts, hp.preset, backbone)
        missing, unexpected = model.load_state_dict(member.module.model.state_dict(), strict=False)
        if unexpected or any(".delta" not in key for key in missing):
            raise RuntimeError(f"{member.spec.label}: weights do not fit the stacked model "
                               f"(missing {missing}, unexpected {unexpected})")
        return model

    def _step_budget(self) -> int:
        """The solo trainer's step budget: ``max_steps``, else epochs x batches."""
        steps, epochs = self.settings["max_steps"], self.settings["max_epochs"]
        by_epochs = self.batches_per_epoch * epochs if epochs not in (None, -1) else math.inf
        budget = min(steps if steps != -1 else math.inf, by_epochs)
        if not math.isfinite(budget):
            raise ValueError("the ensemble needs a length: set trainer.max_steps or max_epochs")
        return int(budget)

    # The step ------------------------------------------------------------------------------
    def _member_predictions(self, params, buffers, fields_: dict[str, Tensor]) -> Tensor:
        return functional_call(self.template.model, (params, buffers), (GraphBatch.from_tensors(fields_),))

    def _member_loss(self, params, buffers, fields_: dict[str, Tensor]) -> Tensor:
        return self.template._loss(self._member_predictions(params, buffers, fields_), fields_["y"])

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=self.autocast_dtype or torch.float32,
                              enabled=self.autocast_dtype is not None,
                              cache_enabled=not self.cuda_graph)  # a graph keeps no cast cache

    def _point_lr(self) -> None:
        """Every param group reads the one learning-rate tensor (CUDA graphs)."""
        if self._lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = self._lr

    def train_step(self, batch: dict[str, Tensor]) -> Tensor:
        """One optimizer step of every member on its batch ``[M, ...]``; returns the losses
        ``[M]`` (on the device, not read)."""
        self.template.train()
        lr = self.scheduler.get_last_lr()[0]  # restored with the scheduler on resume
        if not self.cuda_graph:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            losses = self._step_body(batch)
        else:
            self._lr.fill_(lr)
            if self._eager_steps < GRAPH_WARMUP_STEPS:  # lazy initialisations, off the main stream
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    losses = self._step_body(batch)
                torch.cuda.current_stream().wait_stream(stream)
                self._eager_steps += 1
            else:
                losses = self._replay(batch)
        self.scheduler.step()
        self.step += 1
        return losses

    def _replay(self, batch: dict[str, Tensor]) -> Tensor:
        """The step as a CUDA graph: captured at the first call (on static copies of the batch
        tensors), then the batch is copied into those and the graph replayed."""
        if self._graph is None:
            self._static_batch = {name: t.clone() for name, t in batch.items()}
            self._graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self._graph):
                self._static_losses = self._step_body(self._static_batch)
        else:
            for name, t in batch.items():
                self._static_batch[name].copy_(t, non_blocking=True)
        self._graph.replay()
        return self._static_losses.clone()

    def _step_body(self, batch: dict[str, Tensor]) -> Tensor:
        """Forward, backward, the rpe members' C mask, per-member clipping and AdamW: device
        work only, no host sync, fixed shapes."""
        # Gradients are zeroed in place, not freed: the same tensors every step (and their
        # per-member views, _member_grads).
        self.optimizer.zero_grad(set_to_none=False)
        with self._autocast():
            losses = self._train_step(self.params, self.buffers, batch)
        losses.sum().backward()
        for name, mask in self.grad_masks.items():
            self.params[name].grad.mul_(mask)
        clip = self.settings["gradient_clip_val"]
        if clip:
            # clip_grad_norm_'s arithmetic for each member's own gradients: norms of its tensors,
            # the norm of those, and one scale, all with foreach kernels (a few per member).
            for grads in self._member_grads():
                total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
                torch._foreach_mul_(grads, (clip / (total + 1e-6)).clamp(max=1.0))
        self.optimizer.step()
        return losses.detach()

    def _member_grads(self) -> list[list[Tensor]]:
        """Member ``m``'s gradients: views ``grad[m]`` of the stacked gradients (built once)."""
        grads = [p.grad for p in self.params.values()]
        if getattr(self, "_grad_views_of", None) is not grads[0]:
            self._grad_views = [[g[m] for g in grads] for m in range(len(self.members))]
            self._grad_views_of = grads[0]
        return self._grad_views

    def member_batches(self, orders: Sequence[tuple[np.ndarray, Tensor | None]],
                       batch_index: int) -> dict[str, Tensor]:
        """Batch ``batch_index`` of every member's epoch order (host ids, and the same ids on
        the device where the split is resident), padded to one shape, stacked on the device."""
        part = slice(batch_index * self.batch_size, (batch_index + 1) * self.batch_size)
        if self.resident is not None:
            batches = [self.resident.batch(order[part], on_device[part]) for order, on_device in orders]
        else:
            batches = [self.train_data.__getitems__(order[part]) for order, _ in orders]
        stacked = stack_batches(batches)
        return {name: t.to(self.device, non_blocking=True) for name, t in stacked.items()}

    def epoch_orders(self) -> list[tuple[np.ndarray, Tensor | None]]:
        """Every member's order of this epoch (its sampler's), on the host and the device."""
        orders = []
        for sampler in self.samplers:
            sampler.set_epoch(self.epoch)
            order = sampler.permutation()
            orders.append((order, torch.from_numpy(order).to(self.device)
                           if self.resident is not None else None))
        return orders

    # Evaluation ----------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, loader, num_batches: int | None = None) -> Tensor:
        """Every member's MAE over the first ``num_batches`` batches of ``loader`` (all by
        default), float64 ``[M]`` on the CPU."""
        self.template.eval()
        abs_error = torch.zeros(len(self.members), dtype=torch.float64, device=self.device)
        count = torch.zeros((), dtype=torch.float64, device=self.device)
        for index, batch in enumerate(loader):
            if num_batches is not None and index >= num_batches:
                break
            batch = batch.to(self.device)
            with self._autocast():
                pred = self._predict(self.params, self.buffers, batch.tensors()).float()
            known = ~torch.isnan(batch.y)
            error = torch.where(known, pred - batch.y, 0.0).abs()
            abs_error += error.flatten(1).sum(1).double()
            count += known.sum()
        return (abs_error / count).cpu()

    # Checkpoints ---------------------------------------------------------------------------
    def member_state_dict(self, index: int) -> dict[str, Tensor]:
        """Member ``index``'s ``GraphormerModule`` state dict (an rpe member without C)."""
        member = self.members[index]
        names = set(member.module.state_dict())
        return {f"model.{name}": p[index].detach().to("cpu", copy=True)
                for name, p in {**self.params, **self.buffers}.items() if f"model.{name}" in names}

    def _member_checkpoint(self, index: int) -> dict[str, Any]:
        """The dict a solo ``graphormer-urpe fit`` saves, for member ``index`` (weights,
        hyperparameters, counters and its ModelCheckpoint state)."""
        member = self.members[index]
        callback = member.checkpoint
        return {"epoch": self.epoch, "global_step": self.step,
                "pytorch-lightning_version": pl.__version__,
                "state_dict": self.member_state_dict(index),
                "callbacks": {callback.state_key: callback.state_dict()},
                "hparams_name": "kwargs", "hyper_parameters": dict(member.module.hparams)}

    def _save_member_checkpoints(self, val_mae: Tensor | None) -> None:
        """After a validation: a member's new best is saved (the old best removed, top 1), then
        every member's ``last.ckpt``."""
        for index, member in enumerate(self.members):
            callback = member.checkpoint
            dirpath = Path(callback.dirpath)
            dirpath.mkdir(parents=True, exist_ok=True)
            if val_mae is not None:
                score = torch.tensor(float(val_mae[index]))
                callback.current_score = score
                best = self.best[index]
                if math.isfinite(score) and (best is None or score < best[1]):
                    path = Path(callback.format_checkpoint_name(  # in callback.dirpath
                        {"epoch": self.epoch, "step": self.step, "val/mae": score}))
                    callback.best_model_path, callback.best_model_score = str(path), score
                    callback.best_k_models = {str(path): score}
                    callback.kth_best_model_path, callback.kth_value = str(path), score
                    _atomic_save(self._member_checkpoint(index), path)
                    if best is not None and best[0] != str(path):
                        Path(best[0]).unlink(missing_ok=True)
                    self.best[index] = (str(path), float(score))
            last = dirpath / f"{callback.CHECKPOINT_NAME_LAST}{callback.FILE_EXTENSION}"
            callback.last_model_path = str(last)
            _atomic_save(self._member_checkpoint(index), last)

    def _local_best(self, member: Member, best: tuple[str, float] | None) -> tuple[str, float] | None:
        """A saved best checkpoint, found by name in the member's checkpoint directory (a state
        moved with its run directories still finds them). A missing file is forgotten, so the
        next validation saves a new best instead of pointing at nothing."""
        if best is None:
            return None
        path = Path(member.checkpoint.dirpath) / Path(best[0]).name
        if not path.exists():
            self.progress(f"ensemble: {member.spec.label}'s best checkpoint {path} is missing; "
                          "the next validation saves a new one")
            return None
        return str(path), best[1]

    def _restore_callbacks(self) -> None:
        for member, best in zip(self.members, self.best):
            if best is not None:
                score = torch.tensor(best[1])
                member.checkpoint.best_model_path, member.checkpoint.best_model_score = best[0], score
                member.checkpoint.best_k_models = {best[0]: score}
                member.checkpoint.kth_best_model_path, member.checkpoint.kth_value = best[0], score

    # Resume --------------------------------------------------------------------------------
    @property
    def state_path(self) -> Path:
        return self.state_dir / STATE_FILE

    def _check_finite(self) -> None:
        finite = torch.stack([torch.isfinite(p).flatten(1).all(1) for p in self.params.values()])
        bad = [member.spec.label for member, ok in zip(self.members, finite.all(0).tolist()) if not ok]
        if bad:
            raise FloatingPointError(f"non-finite weights in {bad} at step {self.step}: lower the "
                                     "learning rate; the last good checkpoints are untouched")

    def save_state(self) -> None:
        self._check_finite()
        state = {"members": [list(m.spec.cli_args) for m in self.members],
                 "params": {n: p.detach() for n, p in self.params.items()},
                 "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                 "step": self.step, "epoch": self.epoch, "best": self.best,
                 "rng": torch.get_rng_state(),
                 "cuda_rng": torch.cuda.get_rng_state_all() if self.device.type == "cuda" else None}
        _atomic_save(state, self.state_path)

    def _resume(self) -> None:
        if not self.state_path.exists():
            return
        state = read_checkpoint(self.state_path, self.device, what="ensemble state")
        if state["members"] != [list(m.spec.cli_args) for m in self.members]:
            raise ValueError(f"{self.state_path} belongs to other runs; remove it or choose "
                             "another directory")
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(state["params"][name])
        self.optimizer.load_state_dict(state["optimizer"])
        set_optimizer_kernel(self.optimizer)
        self._point_lr()
        self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.epoch = state["step"], state["epoch"]
        self.best = [self._local_best(member, best) for member, best in zip(self.members, state["best"])]
        torch.set_rng_state(state["rng"].cpu())
        if state["cuda_rng"] is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda_rng"]])
        self._restore_callbacks()
        self._drop_rows_after_state()
        self.progress(f"ensemble: resuming at step {self.step} (epoch {self.epoch}) from {self.state_path}")

    # The loop ------------------------------------------------------------------------------
    @property
    def max_steps(self) -> int:
        return self._step_budget()

    @property
    def done(self) -> bool:
        return self.step >= self.max_steps

    def _log_rows(self, rows: list[dict[str, Any]]) -> None:
        """Append each member's metrics to ``<run dir>/csv/ensemble/metrics.csv``."""
        for member, row in zip(self.members, rows):
            path = member.run_dir / METRICS_FILE
            path.parent.mkdir(parents=True, exist_ok=True)
            new = not path.exists()
            with open(path, "a", newline="") as handle:
                writer = csv.DictWriter(handle, METRICS_COLUMNS)
                if new:
                    writer.writeheader()
                writer.writerow(row)

    def _drop_rows_after_state(self) -> None:
        """Metric rows logged after the saved state (a run stopped between two saves) are
        removed: the resumed run logs those steps again."""
        for member in self.members:
            path = member.run_dir / METRICS_FILE
            if not path.exists():
                continue
            with open(path, newline="") as handle:
                rows = list(csv.DictReader(handle))
            kept = [row for row in rows if int(row["step"]) < self.step]
            if len(kept) < len(rows):
                with atomic_write(path) as handle:
                    writer = csv.DictWriter(handle, METRICS_COLUMNS)
                    writer.writeheader()
                    writer.writerows(kept)

    def fit(self, stop_at_step: int | None = None) -> None:
        """Train to the budget (or to the first epoch end at or after ``stop_at_step``: a chunk,
        saved so a later :meth:`fit` continues), validating and checkpointing as a solo run."""
        log_every = max(1, int(self.settings["log_every_n_steps"] or 50))
        every_n_epochs = int(self.settings["check_val_every_n_epoch"])
        last_save, start = time.monotonic(), time.monotonic()
        start_step = self.step
        loss_sum, loss_steps = torch.zeros(len(self.members), device=self.device), 0
        while not self.done:
            orders = self.epoch_orders()
            batch_index = 0
            while batch_index < self.batches_per_epoch and not self.done:
                loss_sum += self.train_step(self.member_batches(orders, batch_index))
                loss_steps += 1
                batch_index += 1
                if self.step % log_every == 0:
                    losses = (loss_sum / loss_steps).tolist()
                    if not all(map(math.isfinite, losses)):
                        bad = [m.spec.label for m, v in zip(self.members, losses) if not math.isfinite(v)]
                        raise FloatingPointError(f"training loss is not finite for {bad} at step "
                                                 f"{self.step}; the last good checkpoints are untouched")
                    self._log_rows([{"epoch": self.epoch, "step": self.step - 1, "train/loss": v}
                                    for v in losses])
                    rate = (self.step - start_step) / (time.monotonic() - start)
                    self.progress(f"ensemble: step {self.step}/{self.max_steps}, {rate:.1f} steps/s, "
                                  f"loss {' '.join(f'{v:.4f}' for v in losses)}")
                    loss_sum.zero_()
                    loss_steps = 0
            if batch_index < self.batches_per_epoch:  # the budget ended inside the epoch
                break
            validated = (self.epoch + 1) % every_n_epochs == 0 and self.num_val_batches > 0
            if validated:
                val_mae = self.evaluate(self.val_loader, self.num_val_batches)
                self._check_finite()
                self._log_rows([{"epoch": self.epoch, "step": self.step - 1, "val/mae": float(v)}
                                for v in val_mae])
                self._save_member_checkpoints(val_mae)
                self.progress(f"ensemble: epoch {self.epoch}, val MAE "
                              f"{' '.join(f'{float(v):.4f}' for v in val_mae)}")
            self.epoch += 1
            chunk_done = stop_at_step is not None and self.step >= stop_at_step
            if validated or chunk_done or time.monotonic() - last_save >= self.save_every_s:
                self.save_state()
                last_save = time.monotonic()
            if chunk_done:
                return
        self._check_finite()
        self._save_member_checkpoints(None)
        self.save_state()


def _atomic_save(obj: Any, path: Path) -> None:
    with atomic_write(path, binary=True) as handle:
        torch.save(obj, handle)

r"""Several runs of one recipe trained side by side in one process, as one stacked model.

The ablation's grid (arms ``urpe`` / ``rpe`` x seeds) is ``M`` runs of the same Graphormer that
differ only in their seed and in whether C is learned. :class:`StackedModule` trains them as ONE
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
  carries) that ``graphormer-urpe test``, ``graphormer-urpe-predict`` and ``model.init_from``
  read as they are.

An ``rpe`` member is stacked as URPE with ``C`` frozen at exactly 1: its ``delta = C - 1`` starts
at 0 and its gradient is masked to 0, so AdamW (moments 0, decay of 0) keeps it at 0 bit for bit,
and ``softmax(.) * 1`` is the RPE probabilities bit for bit. Its checkpoint is the plain
``attention: rpe`` model (no C), with the hyperparameters of its solo run.

Lightning's loop drives it as it drives a solo run (the training engine's pattern,
:class:`~graphormer_urpe.training.engine.OwnStepHooks`: the whole step runs inside Lightning's
optimizer-step hook): epochs, the step budget, the host ``LambdaLR``, validation every
``check_val_every_n_epoch`` epochs, and resume. Batches of all members are padded to one shape
(:class:`~graphormer_urpe.data.batch.BatchPadding` over the training split) and stacked to
``[M, ...]`` (:class:`StackedBatches`); the step reads nothing back to the host, so on a GPU it
can be captured whole in one CUDA graph and replayed (``cuda_graph=True``). Losses are read every
``log_every_n_steps`` into each member's ``csv/ensemble/metrics.csv``. Divergence is handled as
the training engine handles it: a step in which any member's loss or gradient is not finite is
skipped on the device (the fused AdamW's ``found_inf``: no parameter, moment or step count
moves, for any member), skipped steps are reported with the members at fault, and an interval
of only skipped steps stops the run before anything is saved.

The whole ensemble is one Lightning checkpoint, ``state.ckpt`` (stacked parameters, AdamW and
schedule state, the loops' counters, RNG states, each member's best checkpoint), written at the
end of an epoch (at most every ``save_every_s`` seconds, and after every validation); a new
:class:`Ensemble` over the same members resumes from it exactly. A ``state.pt`` written by
earlier versions (the same state, saved by hand) resumes too, and is removed once the first
``state.ckpt`` replaces it. SIGINT (Ctrl-C) and SIGTERM are held to the end of the epoch in
progress, where the state is saved and the fit stops (:class:`EnsembleStopped`); a second one
stops at once.
"""
from __future__ import annotations

import csv
import inspect
import logging
import math
import signal
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
from lightning.pytorch.trainer.states import TrainerStatus
from lightning.pytorch.utilities.exceptions import SIGTERMException
import torch
from torch import Tensor
from torch.func import functional_call, stack_module_state, vmap

from graphormer_urpe.checkpoint import read_checkpoint
from graphormer_urpe.data.batch import BatchPadding, GraphBatch
from graphormer_urpe.data.dataset import SeededShuffleSampler
from graphormer_urpe.data.resident import ResidentSplit, TensorGraphs
from graphormer_urpe.files import atomic_path, atomic_write
from graphormer_urpe.nn.graphormer import Graphormer, attention_variant
from graphormer_urpe.training.engine import OwnStepHooks, StepCounts, optimizer_update, record_step
from graphormer_urpe.nn.graphormer import build_backbone
from graphormer_urpe.training.module import GraphormerModule
from graphormer_urpe.training.optim import adamw_with_schedule, parameter_groups, set_optimizer_kernel
from graphormer_urpe.training.run_checkpoint import rng_states, set_rng_states
from graphormer_urpe.training.schedule import schedule_lengths

log = logging.getLogger(__name__)

#: The ensemble's Lightning checkpoint in its state directory.
STATE_FILE = "state.ckpt"
#: The state as earlier versions saved it (resumed once, then replaced by :data:`STATE_FILE`).
LEGACY_STATE_FILE = "state.pt"
#: Module options of fine-tuning runs, which the stacked step does not implement.
FINE_TUNING_HPARAMS = ("init_from", "head_lr", "freeze_backbone_steps")
METRICS_FILE = Path("csv") / "ensemble" / "metrics.csv"
#: The columns of each member's :data:`METRICS_FILE`.
METRICS_COLUMNS = ("epoch", "step", "train/loss", "val/mae")
#: Trainer precisions the stacked step runs (autocast dtype or None).
PRECISIONS = {"32-true": None, "32": None, "bf16-mixed": torch.bfloat16}
#: The Lightning checkpoint's keys of the member arguments and of their best checkpoints.
MEMBERS_KEY, BEST_KEY = "ensemble_members", "ensemble_best"


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


class StackedBatches(torch.utils.data.Dataset):
    """Batch ``index`` of every member's epoch order (its own :class:`SeededShuffleSampler`),
    padded to one shape and stacked ``[M, ...]``: the training loader's items, one per step.

    Args:
        data: the training split, padded (:meth:`~.dataset.EncodedGraphDataset.padded`).
        samplers: each member's sampler.
        batch_size: graphs per member batch.
        num_batches: batches per epoch.
        device: where the stacked batch goes.
        resident: gather from this device copy of the split instead of the numpy collation.
    """

    def __init__(self, data, samplers: Sequence[SeededShuffleSampler], batch_size: int,
                 num_batches: int, device: torch.device, resident: ResidentSplit | None) -> None:
        self.data, self.samplers, self.batch_size = data, list(samplers), batch_size
        self.num_batches, self.device, self.resident = num_batches, device, resident
        self.orders: list[tuple[np.ndarray, Tensor | None]] = []
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        """Every member's order of ``epoch`` (its sampler's), on the host and, where the split
        is resident, on the device."""
        self.orders = []
        for sampler in self.samplers:
            sampler.set_epoch(epoch)
            order = sampler.permutation()
            self.orders.append((order, torch.from_numpy(order).to(self.device)
                                if self.resident is not None else None))

    def __len__(self) -> int:
        return self.num_batches

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        part = slice(index * self.batch_size, (index + 1) * self.batch_size)
        if self.resident is not None:
            batches = [self.resident.batch(order[part], on_device[part]) for order, on_device in self.orders]
        else:
            batches = [self.data.__getitems__(order[part]) for order, _ in self.orders]
        return {name: t.to(self.device, non_blocking=True) for name, t in stack_batches(batches).items()}


def _stacked_key(name: str) -> str:
    """A parameter name as a key of the module's ``ParameterDict`` (which refuses dots)."""
    return name.replace(".", "/")


class StackedModule(OwnStepHooks, pl.LightningModule):
    """The members' models as one module whose every parameter has a leading member axis,
    trained by Lightning's loop: the whole stacked step (forward, loss, backward, the rpe
    members' C mask, per-member clipping, fused AdamW) runs inside Lightning's optimizer hook,
    and the host ``LambdaLR`` it steps gives the learning rate.

    Args:
        members: the members as their solo runs build them (one recipe; see :class:`Ensemble`).
        batches: the training batches (:class:`StackedBatches`).
        settings: the members' trainer settings (:func:`_trainer_settings`).
        budget: the solo runs' step budget (the schedule's length unless ``model.total_steps``).
        device: where the stacked parameters live.
        cuda_graph: on a GPU, capture the whole step in one CUDA graph after
            :func:`~.engine.record_step`'s update-free warmup and replay it (ignored on a CPU).
        progress: receives the log lines.
        in_turn: the members' forward and backward one member after another on their slices of
            the stacked parameters, instead of all at once through ``vmap``: the same step (one
            backward, per-member clipping, one AdamW), with kernels one member wide, for a GPU
            that one member already keeps busy.
        attention_impl: the attention core of every member's forward: ``eager``, or ``triton``
            (the fused kernels, :mod:`~graphormer_urpe.nn.fused_attention`; ``in_turn`` only,
            since ``vmap`` cannot batch them). How the steps run, not what is trained: the
            members' checkpoints and the saved state are the same with either.
    """

    def __init__(self, members: Sequence[Member], batches: StackedBatches, settings: dict[str, Any],
                 budget: int, device: torch.device, cuda_graph: bool = False,
                 progress: Callable[[str], None] = log.info, in_turn: bool = False,
                 attention_impl: str = "eager") -> None:
        super().__init__()
        check_attention_impl(attention_impl, in_turn)
        self.members, self.batches, self.settings = list(members), batches, settings
        self.budget, self.progress = int(budget), progress
        if attention_impl == "triton" and device.type != "cuda":
            from graphormer_urpe.nn.fused_attention import kernels_run_on

            if not kernels_run_on(device):
                progress("attention_impl triton: the fused kernels run on a GPU (or under Triton's "
                         "interpreter); on this CPU the members' attention runs the eager core")
        self.hp = dict(self.members[0].module.hparams)
        # One structure for all: URPE (per-layer C), not compiled.
        backbone = {**self.hp["backbone"], "attention": "urpe", "share_urpe_scale": False,
                    "attention_impl": attention_impl}
        params, buffers = stack_module_state([_as_urpe(member, backbone) for member in self.members])
        self.names = list(params)
        self.stacked = torch.nn.ParameterDict({_stacked_key(name): torch.nn.Parameter(p.detach().to(device))
                                               for name, p in params.items()})
        self.stacked_buffers = {name: b.to(device) for name, b in buffers.items()}
        # Lightning's ``self.device`` follows ``.to()`` only: without it a GPU module would name
        # the CPU until a trainer moves it, and a step taken before fit (the benchmark's) would
        # put the optimizer's flags and the step counts there.
        self.to(device)
        init_args = inspect.signature(GraphormerModule).parameters  # not the CLI's _instantiator
        template = GraphormerModule(**{**{k: v for k, v in self.hp.items() if k in init_args},
                                       "backbone": backbone, "compile": False, "engine": False})
        # Not a submodule: its own weights are never used (functional_call passes the stacked
        # ones), so they stay out of the checkpoint and the optimizer.
        self.__dict__["template"] = template.to(device)
        if self.hp.get("matmul_precision"):
            torch.set_float32_matmul_precision(self.hp["matmul_precision"])
        # rpe members: gradient of every C entry masked to 0 (C stays exactly 1).
        keep = torch.tensor([0.0 if m.frozen_scale else 1.0 for m in self.members], device=device)
        self.grad_masks = {name: keep.view(-1, *[1] * (p.dim() - 1))
                           for name, p in params.items() if ".delta" in name}
        self.clip = float(settings["gradient_clip_val"] or 0.0)
        self.autocast_dtype = PRECISIONS[str(settings["precision"])]
        self.cuda_graph = bool(cuda_graph) and device.type == "cuda"
        # Under a CUDA graph every param group reads this one device tensor, filled with the
        # schedule's rate before every replay.
        self._lr = torch.tensor(float(self.hp["lr"]), device=device) if self.cuda_graph else None
        self._graph: torch.cuda.CUDAGraph | None = None
        self.optimizer: torch.optim.AdamW | None = None
        self.best: list[tuple[str, float] | None] = [None] * len(self.members)
        self.validated_epoch = -1
        self.legacy_state: dict[str, Any] | None = None  # an earlier version's state.pt to resume
        self._resumed_rng: dict[str, Any] | None = None
        # model.compile: the stacked forward and backward compiled whole, or in turn the one
        # member's (one graph for every member: the same shapes).
        self.in_turn = bool(in_turn)
        if self.in_turn:
            self._member_step = torch.compile(self._member_loss) if self.hp.get("compile") else self._member_loss
            self._train_step = self._members_in_turn
        else:
            self._train_step = vmap(self._member_loss, in_dims=(0, 0, 0), randomness="different")
            if self.hp.get("compile"):
                self._train_step = torch.compile(self._train_step)
        self._predict = (self._predictions_in_turn if self.in_turn else
                         vmap(self._member_predictions, in_dims=(0, 0, None), randomness="different"))

    @property
    def params(self) -> dict[str, Tensor]:
        """The stacked parameters ``[M, ...]`` by the backbone's parameter names."""
        return {name: self.stacked[_stacked_key(name)] for name in self.names}

    @property
    def member_args(self) -> list[list[str]]:
        return [list(member.spec.cli_args) for member in self.members]

    def train(self, mode: bool = True):
        self.template.train(mode)  # dropout on or off: the template's modules run the forward
        return super().train(mode)

    # The step ------------------------------------------------------------------------------
    def _member_predictions(self, params, buffers, fields_: dict[str, Tensor]) -> Tensor:
        return functional_call(self.template.model, (params, buffers), (GraphBatch.from_tensors(fields_),))

    def _member_loss(self, params, buffers, fields_: dict[str, Tensor]) -> Tensor:
        return self.template._loss(self._member_predictions(params, buffers, fields_), fields_["y"])

    def _per_member(self, *stacked: dict[str, Tensor]) -> list[tuple[dict[str, Tensor], ...]]:
        """Each member's slices of the ``[M, ...]`` tensor dicts ``stacked``, one tuple per member:
        ``unbind`` once per tensor, so a backward stacks each parameter's member gradients in one
        write."""
        unbound = [{name: t.unbind(0) for name, t in tensors.items()} for tensors in stacked]
        return [tuple({name: t[m] for name, t in tensors.items()} for tensors in unbound)
                for m in range(len(self.members))]

    def _predictions_in_turn(self, params, buffers, fields_: dict[str, Tensor]) -> Tensor:
        """Every member's predictions ``[M, ...]`` on one batch, one member after another."""
        return torch.stack([self._member_predictions(member_params, member_buffers, fields_)
                            for member_params, member_buffers in self._per_member(params, buffers)])

    def _members_in_turn(self, params, buffers, batch: dict[str, Tensor]) -> Tensor:
        """The members' losses ``[M]`` (``in_turn``), each from its slice of the stacked
        parameters, buffers and batch."""
        return torch.stack([self._member_step(*slices) for slices in self._per_member(params, buffers, batch)])

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=self.autocast_dtype or torch.float32,
                              enabled=self.autocast_dtype is not None,
                              cache_enabled=not self.cuda_graph)  # a graph keeps no cast cache

    def build_optimizer(self) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
        """AdamW over the stacked parameters in the solo run's param groups (one per parameter
        kind), fused (capturable under a CUDA graph), and the solo run's schedule."""
        hp = self.hp
        self._graph = None  # a recorded step would update the old optimizer
        names = {id(p): name for name, p in self.template.model.named_parameters()}
        params = self.params
        groups = [{**group, "params": [params[names[id(p)]] for p in group["params"]]}
                  for group in parameter_groups(self.template.model, hp["weight_decay"],
                                                hp.get("no_weight_decay") or ())]
        warmup_steps, total_steps = schedule_lengths(hp["lr"], hp["end_lr"], hp["warmup_steps"],
                                                     hp.get("warmup_fraction"), hp["total_steps"],
                                                     self.budget)
        self.optimizer, scheduler = adamw_with_schedule(groups, hp, warmup_steps, total_steps, fused=True,
                                                        capturable=self.cuda_graph)
        # 1.0: skip the update (the fused kernel's found_inf; force_skip while a step is being
        # recorded); the interval's counts.
        self.optimizer.found_inf = torch.zeros((), device=self.device)
        self.force_skip = torch.zeros((), device=self.device)
        self.counts = StepCounts(len(self.members), self.device)
        return self.optimizer, scheduler

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer, scheduler = self.build_optimizer()
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}

    def train_step(self, batch: dict[str, Tensor]) -> Tensor:
        """One optimizer step of every member on its batch ``[M, ...]`` at the learning rate the
        param groups hold (the schedule's); the losses ``[M]`` (on the device, not read). Under a
        CUDA graph the first call records the step on static copies of the batch tensors
        (:func:`~.engine.record_step`, as the training engine records its own); every call
        copies its batch into those and replays the graph."""
        self.template.train()
        if not self.cuda_graph:
            return self._step_body(batch)
        self._lr.fill_(self.optimizer.param_groups[0]["lr"])  # every group has the same peak
        if self._graph is None:
            self._static_batch = {name: t.clone() for name, t in batch.items()}
            self._graph, self._static_losses = record_step(lambda: self._step_body(self._static_batch),
                                                           self.force_skip, self.counts)
        else:
            for name, t in batch.items():
                self._static_batch[name].copy_(t, non_blocking=True)
        self._graph.replay()
        return self._static_losses.clone()

    def _step_body(self, batch: dict[str, Tensor]) -> Tensor:
        """Forward, backward, the rpe members' C mask, per-member clipping and AdamW: device
        work only, no host sync, fixed shapes."""
        params = self.params
        # Gradients are zeroed in place, not freed: the same tensors every step (and their
        # per-member views, _member_grads).
        self.optimizer.zero_grad(set_to_none=False)
        with self._autocast():
            losses = self._train_step(params, self.stacked_buffers, batch)
        losses.sum().backward()
        for name, mask in self.grad_masks.items():
            params[name].grad.mul_(mask)
        # Per-member clipping, the engine's divergence policy (a step with a non-finite loss or
        # gradient of any member changes nothing: the fused AdamW skips all or none), AdamW and
        # the interval's counts.
        lrs = [self._lr] * len(self.optimizer.param_groups) if self._lr is not None else None
        optimizer_update(self.optimizer, self._member_grads(), losses, self.clip, self.counts, lrs,
                         self.force_skip)
        return losses.detach()

    def _member_grads(self) -> list[list[Tensor]]:
        """Member ``m``'s gradients: views ``grad[m]`` of the stacked gradients (built once)."""
        grads = [p.grad for p in self.params.values()]
        if getattr(self, "_grad_views_of", None) is not grads[0]:
            self._grad_views = [[g[m] for g in grads] for m in range(len(self.members))]
            self._grad_views_of = grads[0]
        return self._grad_views

    # Lightning's loop ----------------------------------------------------------------------
    def on_train_start(self) -> None:
        # A checkpoint restores the kernel flags of the run that saved it (CPU or GPU).
        set_optimizer_kernel(self.optimizer)
        if self.legacy_state is not None:
            self._resume_legacy(self.legacy_state)
            self.legacy_state = None
        if self._resumed_rng is not None:  # after anything set-up draws, before the first step
            set_rng_states(self._resumed_rng)
            self._resumed_rng = None
        if self.global_step > 0:
            self._drop_rows_after(self.global_step)
            self.progress(f"ensemble: resuming at step {self.global_step}")
        self.batches.set_epoch(self.current_epoch)
        self.total_skipped = 0
        self._start, self._start_step = time.monotonic(), self.global_step

    def on_train_epoch_start(self) -> None:
        self.batches.set_epoch(self.current_epoch)

    def on_validation_model_zero_grad(self) -> None:
        # Lightning frees the gradients before a validation; the step zeroes them in place
        # instead, so they (and a recorded graph's writes into them) stay where they are.
        pass

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        losses = self.train_step(batch)
        step = self.global_step + 1  # counted once this hook returns
        if step % max(1, int(self.settings["log_every_n_steps"] or 50)) == 0:
            self._report(step)
        return losses.sum()

    def check_skipped(self) -> None:
        """FloatingPointError naming the members at fault if every step since the last report
        was skipped: before a checkpoint is written and at the end."""
        skipped, bad = self.counts.all_skipped()
        if skipped:
            self._diverged(skipped, bad, self.global_step)

    def _diverged(self, skipped: int, bad: list[float], step: int) -> None:
        raise FloatingPointError(
            f"every training step of the last {skipped} had a non-finite loss or gradient in "
            f"{self._labels(bad)} (up to step {step}); no update was applied and no checkpoint "
            "holds a diverged model: lower the learning rate")

    def _labels(self, counts: list[float]) -> list[str]:
        """The labels of the members whose count is not 0."""
        return [member.spec.label for member, count in zip(self.members, counts) if count]

    def _report(self, step: int) -> None:
        """Read the interval's counts (one device-to-host copy), stop if no step of it was
        applied, log the members' mean losses and any skipped steps."""
        loss_sums, applied, skipped, bad = self.counts.read()
        if skipped and not applied:
            self._diverged(int(skipped), bad, step)
        self.counts.reset()
        if skipped:
            self.total_skipped += int(skipped)
            self.progress(f"ensemble: skipped {int(skipped)} of the last {int(applied + skipped)} steps "
                          f"before step {step} (a non-finite loss or gradient in {self._labels(bad)}); "
                          f"{self.total_skipped} skipped in all")
        losses = [total / applied for total in loss_sums]
        self._log_rows([{"epoch": self.current_epoch, "step": step - 1, "train/loss": v} for v in losses])
        rate = (step - self._start_step) / (time.monotonic() - self._start)
        self.progress(f"ensemble: step {step}/{self.budget}, {rate:.1f} steps/s, "
                      f"loss {' '.join(f'{v:.4f}' for v in losses)}")

    # Evaluation ----------------------------------------------------------------------------
    def _errors(self, batch: GraphBatch) -> tuple[Tensor, Tensor]:
        """Every member's summed absolute error ``[M]`` (float64) on ``batch``, and its count of
        known labels."""
        batch = batch.to(self.device)
        with self._autocast():
            pred = self._predict(self.params, self.stacked_buffers, batch.tensors()).float()
        known = ~torch.isnan(batch.y)
        error = torch.where(known, pred - batch.y, 0.0).abs()
        return error.flatten(1).sum(1).double(), known.sum().double()

    @torch.no_grad()
    def evaluate(self, loader, num_batches: int | None = None) -> Tensor:
        """Every member's MAE over the first ``num_batches`` batches of ``loader`` (all by
        default), float64 ``[M]`` on the CPU."""
        self.eval()
        error = torch.zeros(len(self.members), dtype=torch.float64, device=self.device)
        count = torch.zeros((), dtype=torch.float64, device=self.device)
        for index, batch in enumerate(loader):
            if num_batches is not None and index >= num_batches:
                break
            batch_error, batch_count = self._errors(batch)
            error += batch_error
            count += batch_count
        return (error / count).cpu()

    def on_validation_epoch_start(self) -> None:
        self._val_error = torch.zeros(len(self.members), dtype=torch.float64, device=self.device)
        self._val_count = torch.zeros((), dtype=torch.float64, device=self.device)

    def validation_step(self, batch: GraphBatch, batch_idx: int) -> None:
        error, count = self._errors(batch)
        self._val_error += error
        self._val_count += count

    def on_validation_epoch_end(self) -> None:
        val_mae = (self._val_error / self._val_count).cpu()
        self.check_skipped()  # before any member checkpoint is written
        self.check_finite()
        self._log_rows([{"epoch": self.current_epoch, "step": self.global_step - 1, "val/mae": float(v)}
                        for v in val_mae])
        self._save_member_checkpoints(val_mae)
        self.progress(f"ensemble: epoch {self.current_epoch}, val MAE "
                      f"{' '.join(f'{float(v):.4f}' for v in val_mae)}")
        self.validated_epoch = self.current_epoch

    def finish(self) -> None:
        """The end of the budget: every member's ``last.ckpt``."""
        self.check_skipped()
        self.check_finite()
        self._save_member_checkpoints(None)

    def check_finite(self) -> None:
        finite = torch.stack([torch.isfinite(p).flatten(1).all(1) for p in self.params.values()])
        bad = [member.spec.label for member, ok in zip(self.members, finite.all(0).tolist()) if not ok]
        if bad:
            raise FloatingPointError(f"non-finite weights in {bad} at step {self.global_step}: lower "
                                     "the learning rate; the last good checkpoints are untouched")

    # Member checkpoints --------------------------------------------------------------------
    def member_state_dict(self, index: int) -> dict[str, Tensor]:
        """Member ``index``'s ``GraphormerModule`` state dict (an rpe member without C)."""
        member = self.members[index]
        names = set(member.module.state_dict())
        return {f"model.{name}": p[index].detach().to("cpu", copy=True)
                for name, p in {**self.params, **self.stacked_buffers}.items() if f"model.{name}" in names}

    def _member_checkpoint(self, index: int) -> dict[str, Any]:
        """The dict a solo ``graphormer-urpe fit`` saves, for member ``index`` (weights,
        hyperparameters, counters and its ModelCheckpoint state)."""
        member = self.members[index]
        callback = member.checkpoint
        return {"epoch": self.current_epoch, "global_step": self.global_step,
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
                        {"epoch": self.current_epoch, "step": self.global_step, "val/mae": score}))
                    _set_best(callback, path, score)
                    _atomic_save(self._member_checkpoint(index), path)
                    if best is not None and best[0] != str(path):
                        Path(best[0]).unlink(missing_ok=True)
                    self.best[index] = (str(path), float(score))
            last = dirpath / f"{callback.CHECKPOINT_NAME_LAST}{callback.FILE_EXTENSION}"
            callback.last_model_path = str(last)
            _atomic_save(self._member_checkpoint(index), last)

    def _restore_best(self, saved: Sequence[tuple[str, float] | None]) -> None:
        """The members' best checkpoints of a saved state, found by name in each member's
        checkpoint directory (a state moved with its run directories still finds them). A
        missing file is forgotten, so the next validation saves a new best instead of pointing
        at nothing."""
        for index, (member, best) in enumerate(zip(self.members, saved)):
            self.best[index] = None
            if best is None:
                continue
            path = Path(member.checkpoint.dirpath) / Path(best[0]).name
            if not path.exists():
                self.progress(f"ensemble: {member.spec.label}'s best checkpoint {path} is missing; "
                              "the next validation saves a new one")
                continue
            self.best[index] = (str(path), float(best[1]))
            _set_best(member.checkpoint, path, torch.tensor(float(best[1])))

    # The ensemble's own checkpoint ---------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.check_skipped()
        self.check_finite()
        checkpoint[MEMBERS_KEY] = self.member_args
        checkpoint[BEST_KEY] = [list(best) if best is not None else None for best in self.best]
        checkpoint["rng_states"] = rng_states()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        check_members(checkpoint.get(MEMBERS_KEY), self.member_args, "the ensemble's state")
        self._restore_best(checkpoint[BEST_KEY])
        self._resumed_rng = checkpoint.get("rng_states")

    def _resume_legacy(self, state: dict[str, Any]) -> None:
        """Continue from a ``state.pt`` of an earlier version: weights, AdamW, the schedule's
        position, the loops' epoch and step counters, best checkpoints and random states."""
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(state["params"][name])
        self.optimizer.load_state_dict(state["optimizer"])
        set_optimizer_kernel(self.optimizer)
        for group in self.optimizer.param_groups:  # a captured run saved its device rate
            group["lr"] = float(group["lr"])
        scheduler = self.lr_schedulers()
        scheduler.last_epoch = int(state["scheduler"]["last_epoch"]) - 1
        with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()"
            warnings.simplefilter("ignore", UserWarning)
            scheduler.step()  # the closed-form rate of that position, in every group
        step, epoch = int(state["step"]), int(state["epoch"])
        fit_loop = self.trainer.fit_loop
        for progress in (fit_loop.epoch_progress.current, fit_loop.epoch_progress.total):
            progress.ready = progress.started = progress.processed = progress.completed = epoch
        steps = fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total
        steps.ready = steps.completed = step
        fit_loop.epoch_loop._batches_that_stepped = step
        if (self.global_step, self.current_epoch) != (step, epoch):
            raise RuntimeError(f"resuming the saved state at step {step}, epoch {epoch} failed "
                               f"(at step {self.global_step}, epoch {self.current_epoch})")
        self._restore_best(state["best"])
        torch.set_rng_state(state["rng"].cpu())
        if state.get("cuda_rng") is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda_rng"]])

    # Metrics -------------------------------------------------------------------------------
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

    def _drop_rows_after(self, step: int) -> None:
        """Metric rows logged at or after ``step`` (a run stopped between two saves) are
        removed: the resumed run logs those steps again."""
        for member in self.members:
            path = member.run_dir / METRICS_FILE
            if not path.exists():
                continue
            with open(path, newline="") as handle:
                rows = list(csv.DictReader(handle))
            kept = [row for row in rows if int(row["step"]) < step]
            if len(kept) < len(rows):
                with atomic_write(path) as handle:
                    writer = csv.DictWriter(handle, METRICS_COLUMNS)
                    writer.writeheader()
                    writer.writerows(kept)


class EnsembleStopped(Exception):
    """A fit stopped by SIGINT or SIGTERM (``signum``) at ``step``: at the end of the epoch the
    signal came in, its state saved (``how`` ``"epoch end"``); ``"at once"`` by a second signal
    (or one before training started), the state of the last save kept; or ``"finished"``: the
    signal came during the last epoch, and the budget was trained and saved."""

    def __init__(self, signum: int, step: int, how: str = "epoch end") -> None:
        name = signal.Signals(signum).name
        message = {
            "epoch end": f"stopped by {name} at the end of an epoch (step {step}); its state is "
                         "saved: the same command resumes it",
            "at once": f"stopped at once by {name} (at step {step}); the same command resumes from "
                       "the state saved last",
            "finished": f"{name} came in the last epoch: training finished (step {step}) and is "
                        "saved; the same command goes on from there"}[how]
        super().__init__(message)
        self.signum, self.step, self.how = signum, step, how


class EnsembleState(pl.Callback):
    """Writes the ensemble's Lightning checkpoint (``path``, atomically) at the end of an epoch
    that validated, or that ends a chunk (``stop_at_step``: the first epoch end at or after that
    step, once a step has run, stops the fit), or when ``save_every_s`` seconds have passed since
    the last save; and when the budget is done, after every member's ``last.ckpt``. A fit
    stopped otherwise saves nothing more: its last state is the one saved at an epoch's end. An
    earlier version's state file (``legacy_path``) is removed once this one replaces it.

    While it trains, SIGINT (Ctrl-C) and SIGTERM (a ``kill``, a scheduler's preemption, a
    ``timeout``) are held to the end of the epoch in progress, where the state is saved and the
    fit stops (``stopped_by``; :meth:`Ensemble.fit` then raises :class:`EnsembleStopped`): at
    most an epoch is trained again. A second such signal stops at once
    (:class:`EnsembleStopped` raised where the training is), keeping the state saved last."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, path: Path, legacy_path: Path, save_every_s: float,
                 stop_at_step: int | None = None, progress: Callable[[str], None] = log.info) -> None:
        self.path, self.legacy_path = path, legacy_path
        self.save_every_s, self.stop_at_step = float(save_every_s), stop_at_step
        self.progress = progress
        self.signal_held: int | None = None  # the first signal, held
        self.stopped_by: int | None = None  # the signal that stopped the fit at an epoch's end
        self._handlers: dict[int, Any] = {}
        self._trainer: pl.Trainer | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: StackedModule) -> None:
        self._last_save, self._first_step = time.monotonic(), trainer.global_step
        self._trainer = trainer
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._handlers[signum] = signal.signal(signum, self._hold)

    def _hold(self, signum: int, frame: Any) -> None:
        if self.signal_held is None:
            self.signal_held = signum  # only this: the handler may interrupt any write
            return
        self._release()  # the second one: at once (a save in progress leaves the last one whole)
        raise EnsembleStopped(signum, self._trainer.global_step, "at once")

    def _release(self) -> None:
        """The handlers this callback replaced, where its own is still in place (Lightning's
        teardown restores the process's originals before the callbacks' teardown runs)."""
        for signum, handler in self._handlers.items():
            if signal.getsignal(signum) == self._hold:
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._handlers = {}

    def on_exception(self, trainer: pl.Trainer, pl_module: StackedModule, exception: BaseException) -> None:
        self._release()

    def teardown(self, trainer: pl.Trainer, pl_module: StackedModule, stage: str) -> None:
        self._release()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: StackedModule) -> None:
        # Lightning resumed from an epoch's end runs that end's hooks again, before any step.
        if trainer.global_step == self._first_step:
            return
        if trainer.global_step >= pl_module.budget:
            return  # the budget is done: on_train_end saves
        chunk_done = self.stop_at_step is not None and trainer.global_step >= self.stop_at_step
        saved = False
        if (chunk_done or self.signal_held is not None or pl_module.validated_epoch == trainer.current_epoch
                or time.monotonic() - self._last_save >= self.save_every_s):
            self.save(trainer)
            saved = True
        signum = self.signal_held  # read once: a signal after this stops at the next epoch's end
        if signum is not None:
            if not saved:  # it came in during the checks above
                self.save(trainer)
            self.stopped_by = signum
            self.progress(f"ensemble: {signal.Signals(signum).name}: stopped at the end of epoch "
                          f"{trainer.current_epoch} (step {trainer.global_step}), its state saved")
        if chunk_done or signum is not None:
            trainer.should_stop = True

    def on_train_end(self, trainer: pl.Trainer, pl_module: StackedModule) -> None:
        if not trainer.should_stop:  # the budget is done (not a chunk's end, nor another stop)
            pl_module.finish()
            self.save(trainer)

    def save(self, trainer: pl.Trainer) -> None:
        with atomic_path(self.path) as temporary:
            trainer.save_checkpoint(temporary)
        self.legacy_path.unlink(missing_ok=True)
        self._last_save = time.monotonic()


def _set_best(callback, path: Path, score: Tensor) -> None:
    """A member's ``ModelCheckpoint`` state (top 1) after its best checkpoint ``path``."""
    callback.best_model_path, callback.best_model_score = str(path), score
    callback.best_k_models = {str(path): score}
    callback.kth_best_model_path, callback.kth_value = str(path), score


#: The attention cores a stacked step runs (its members are URPE models: ``sdpa`` has no C).
ENSEMBLE_ATTENTION_IMPLS = ("eager", "triton")


def step_way(in_turn: bool, attention_impl: str) -> str:
    """How a stacked step runs, as log lines and benchmark rows name it: ``""`` for all members at
    once on the eager core, else e.g. ``"members in turn, triton attention"``."""
    return ", ".join(["members in turn"] * in_turn + [f"{attention_impl} attention"] * (attention_impl != "eager"))


def check_attention_impl(attention_impl: str, in_turn: bool) -> None:
    """``ValueError`` (one line) for an attention core the stacked step cannot run."""
    if attention_impl not in ENSEMBLE_ATTENTION_IMPLS:
        raise ValueError(f"an ensemble's attention_impl is one of {', '.join(ENSEMBLE_ATTENTION_IMPLS)}; "
                         f"got {attention_impl!r}")
    if attention_impl != "eager" and not in_turn:
        raise ValueError(f"attention_impl {attention_impl!r} needs the members in turn (--in-turn): "
                         "vmap cannot batch the fused kernels")


def check_members(saved: Any, members: list[list[str]], what: str) -> None:
    """ValueError unless a saved state was written for these members' arguments (up to
    :data:`~.cli.EXECUTION_ARGS`: a state saved with or without ``--model.compile`` resumes either way)."""
    from graphormer_urpe.training.cli import training_args

    if not isinstance(saved, list) or [training_args(list(args)) for args in saved] != \
            [training_args(args) for args in members]:
        raise ValueError(f"{what} belongs to other runs; remove it or choose another directory")


def _as_urpe(member: Member, backbone: dict) -> Graphormer:
    """The member's weights in the stacked (URPE) structure; an rpe member gets C = 1."""
    hp = member.module.hparams
    model, _ = build_backbone(member.module.facts, hp.preset, backbone)
    missing, unexpected = model.load_state_dict(member.module.model.state_dict(), strict=False)
    if unexpected or any(".delta" not in key for key in missing):
        raise RuntimeError(f"{member.spec.label}: weights do not fit the stacked model "
                           f"(missing {missing}, unexpected {unexpected})")
    return model


class Ensemble:
    """The members of ``specs`` (same recipe, arms ``urpe`` / ``rpe``, any seeds) trained as one
    :class:`StackedModule` on ``device`` (default: the first member's trainer device) by a
    Lightning ``Trainer`` with the members' settings, saving to ``state_dir``
    (:data:`STATE_FILE`, see :class:`EnsembleState`) and resuming from there. ``progress``
    receives the log lines; ``resident``: gather training batches from a device copy of the
    split (default: on a GPU); ``cuda_graph``: on a GPU, capture the whole optimizer step in one
    CUDA graph and replay it (ignored on a CPU); ``in_turn``: the members' forward and backward
    one after another instead of through ``vmap``; ``attention_impl``: their attention core
    (``triton``: the fused kernels, with ``in_turn``) (:class:`StackedModule`)."""

    def __init__(self, specs: Sequence[MemberSpec], state_dir: Path | str,
                 device: torch.device | str | None = None, save_every_s: float = 600.0,
                 progress: Callable[[str], None] | None = None, resident: bool | None = None,
                 cuda_graph: bool = False, in_turn: bool = False, attention_impl: str = "eager") -> None:
        if not specs:
            raise ValueError("an ensemble needs at least one member")
        check_attention_impl(attention_impl, in_turn)  # before the members' data is built
        self.members = [build_member(spec) for spec in specs]
        self.state_dir = Path(state_dir)
        self.save_every_s = float(save_every_s)
        self.progress = progress or log.info
        first = self.members[0]
        self.settings = _trainer_settings(first.trainer)
        self._check_same_recipe()
        self.device = torch.device(device) if device is not None else first.trainer.strategy.root_device

        # Data: the training split once, each member's own sampler.
        dm = first.datamodule
        dm.prepare_data()
        dm.setup("fit")
        train_data = dm.train_dataset()
        self.batch_size = dm.batch_size
        # Every member's batch has one shape: the epoch's last, smaller batch gets empty graphs.
        padding = BatchPadding.covering(train_data.num_nodes, train_data.num_edges, self.batch_size,
                                        pad_graphs=True)
        train_data = train_data.padded(padding)
        # On a GPU the split lives there and batches are gathered there (data/resident.py); on
        # a CPU the numpy collation is the faster one. Both give the same batches.
        if resident is None:
            resident = self.device.type == "cuda"
        self.resident = (ResidentSplit(train_data, TensorGraphs.from_flat(train_data.graphs, self.device))
                         if resident else None)
        sizes = train_data.num_nodes if dm.bucket_batches else None
        samplers = [SeededShuffleSampler(len(train_data), m.datamodule.seed, self.batch_size,
                                         sizes=sizes, bucket_batches=dm.bucket_batches)
                    for m in self.members]
        full = (len(train_data) // self.batch_size if dm.static_shapes
                else math.ceil(len(train_data) / self.batch_size))
        self.batches_per_epoch = _limit(full, self.settings["limit_train_batches"])
        if self.batches_per_epoch < 1:
            raise ValueError(f"no training batch per epoch ({len(train_data)} graphs, batch size "
                             f"{self.batch_size}, limit_train_batches {self.settings['limit_train_batches']})")
        self.batches = StackedBatches(train_data, samplers, self.batch_size, self.batches_per_epoch,
                                      self.device, self.resident)
        self.val_loader = dm.val_dataloader()

        self.module = StackedModule(self.members, self.batches, self.settings, self._step_budget(),
                                    self.device, cuda_graph, self.progress, in_turn, attention_impl)
        # No per-batch host reads (vmap has none of the per-member values) nor data-dependent
        # sizes (the CPU's packed hop sum): the split's ids are checked once here.
        model = self.module.template.model
        model.make_capture_safe(train_data.graphs.x, train_data.graphs.edge_attr)
        val_graphs = dm.splits["val"].graphs
        model.check_ids(val_graphs.x, val_graphs.edge_attr)
        #: The step a :meth:`fit` starts from (a saved state's, else 0).
        self.step = self._read_state()

    @property
    def state_path(self) -> Path:
        return self.state_dir / STATE_FILE

    @property
    def legacy_state_path(self) -> Path:
        return self.state_dir / LEGACY_STATE_FILE

    @property
    def params(self) -> dict[str, Tensor]:
        return self.module.params

    @property
    def template(self) -> GraphormerModule:
        return self.module.template

    def evaluate(self, loader, num_batches: int | None = None) -> Tensor:
        return self.module.evaluate(loader, num_batches)

    def _read_state(self) -> int:
        """The saved state's step, after checking that it belongs to these members (one
        read, ``weights_only``); an earlier version's ``state.pt`` is kept for the fit."""
        if self.state_path.exists():
            state = read_checkpoint(self.state_path, "cpu", what="ensemble state")
            check_members(state.get(MEMBERS_KEY), self.module.member_args, str(self.state_path))
            return int(state["global_step"])
        if self.legacy_state_path.exists():
            state = read_checkpoint(self.legacy_state_path, self.device, what="ensemble state")
            check_members(state["members"], self.module.member_args, str(self.legacy_state_path))
            self.module.legacy_state = state
            return int(state["step"])
        return 0

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
                raise ValueError(f"{member.spec.label}: --ensemble needs the recipe's attention_impl "
                                 f"eager (got {backbone['attention_impl']!r}); the ensemble's own "
                                 "--attention-impl picks the core its steps run")
            if member.module.task.name != "regression":
                raise ValueError(f"{member.spec.label}: --ensemble trains regression (val/mae)")
            fine_tuning = sorted(k for k in FINE_TUNING_HPARAMS if member.module.hparams.get(k))
            if fine_tuning:
                raise ValueError(f"{member.spec.label}: --ensemble trains from scratch, without "
                                 f"model.{', model.'.join(fine_tuning)}")
            if recipe(member) != recipe(first) or _trainer_settings(member.trainer) != self.settings:
                raise ValueError(f"{member.spec.label} differs from {first.spec.label} in more "
                                 "than the seed and the arm; an ensemble trains one recipe")

    def _step_budget(self) -> int:
        """The solo trainer's step budget: ``max_steps``, else epochs x batches."""
        steps, epochs = self.settings["max_steps"], self.settings["max_epochs"]
        by_epochs = self.batches_per_epoch * epochs if epochs not in (None, -1) else math.inf
        budget = min(steps if steps != -1 else math.inf, by_epochs)
        if not math.isfinite(budget):
            raise ValueError("the ensemble needs a length: set trainer.max_steps or max_epochs")
        return int(budget)

    # Training ------------------------------------------------------------------------------
    def trainer(self, callbacks: Sequence[pl.Callback] = ()) -> pl.Trainer:
        """The Lightning trainer of the stacked module: the members' loop settings, one device;
        no logger (each member's metrics file is written by the module), no checkpoint callback
        but the ensemble's own; the module does its own clipping and autocast."""
        s = self.settings
        return pl.Trainer(
            accelerator=self.device.type,
            devices=[self.device.index or 0] if self.device.type == "cuda" else 1,
            max_steps=s["max_steps"], max_epochs=s["max_epochs"],
            limit_val_batches=s["limit_val_batches"], check_val_every_n_epoch=s["check_val_every_n_epoch"],
            log_every_n_steps=s["log_every_n_steps"], num_sanity_val_steps=0,
            default_root_dir=self.state_dir, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, inference_mode=False,
            callbacks=list(callbacks))

    def fit(self, stop_at_step: int | None = None, callbacks: Sequence[pl.Callback] = ()) -> None:
        """Train to the budget (or to the first epoch end at or after ``stop_at_step``: a chunk,
        saved so a later :meth:`fit` continues), validating and checkpointing as a solo run;
        ``callbacks``: more Lightning callbacks (a benchmark's timer). :class:`EnsembleStopped`
        after a SIGINT or SIGTERM, at the end of the epoch it arrived in, the state saved."""
        state = EnsembleState(self.state_path, self.legacy_state_path, self.save_every_s, stop_at_step,
                              self.progress)
        trainer = self.trainer([state, *callbacks])
        # Items are whole stacked batches, in order (the members' samplers shuffle); the loader's
        # own generator keeps its per-epoch seed draw off the global one that dropout uses.
        loader = torch.utils.data.DataLoader(self.batches, batch_size=None, generator=torch.Generator())
        self.state_dir.mkdir(parents=True, exist_ok=True)
        ckpt_path = self.state_path if self.state_path.exists() else None
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", ".*does not have many workers.*")
                trainer.fit(self.module, train_dataloaders=loader, val_dataloaders=self.val_loader,
                            ckpt_path=ckpt_path, weights_only=True)
        except SIGTERMException:  # Lightning's own handler, before training started
            raise EnsembleStopped(signal.SIGTERM, trainer.global_step, "at once") from None
        except SystemExit:  # Lightning's answer to Ctrl-C outside the training's hold
            if trainer.state.status != TrainerStatus.INTERRUPTED:
                raise
            raise EnsembleStopped(signal.SIGINT, trainer.global_step, "at once") from None
        self.step = trainer.global_step
        if state.stopped_by is not None:
            raise EnsembleStopped(state.stopped_by, self.step)
        if state.signal_held is not None:  # it came in the last epoch, which then finished
            raise EnsembleStopped(state.signal_held, self.step, "finished")


def _atomic_save(obj: Any, path: Path) -> None:
    with atomic_write(path, binary=True) as handle:
        torch.save(obj, handle)

r"""The one training step: the whole optimizer step as one replayable function, on a GPU one CUDA graph.

Every ``fit`` of :class:`~graphormer_urpe.training.module.GraphormerModule` trains with
:class:`TrainingEngine`. One step is

.. math::
    \text{items} &= \text{order}[s : s + B], \quad \text{batch} = \text{gather}(\text{items})
        \quad \text{(fixed shapes, } :func:`~graphormer_urpe.data.batch.gather_batch`) \\
    \ell &= \text{loss}(f_\theta(\text{batch}), y), \quad g = \nabla_\theta \ell, \quad
        g \leftarrow g \cdot \min\big(1, \tfrac{c}{\lVert g \rVert_2 + 10^{-6}}\big) \\
    \text{skip} &= \lnot \text{isfinite}(\ell) \lor \lnot \text{isfinite}(\lVert g \rVert_2), \quad
        \eta_g = \hat\eta_g \, r(u + 1) \ (:func:`~.schedule.relative_lr`), \quad
        \theta \leftarrow \text{AdamW}(\theta, g, \eta) \text{ unless skip}

all on the device, with no device-to-host sync: the batch is gathered from the epoch order on
the device (:class:`~graphormer_urpe.data.resident.OrderSlice`), the clipping is
``torch.nn.utils.clip_grad_norm_``'s arithmetic (Lightning's ``gradient_clip_val``), the AdamW is
torch's fused one with a device tensor for the learning rate and ``found_inf`` masking (a
skipped step leaves parameters, moments and the step count untouched, as under a gradient
scaler), and the update counter ``u`` lives on the device. Each param group ``g`` gets its own
peak :math:`\hat\eta_g` (``model.lr``, or ``model.head_lr`` for the head's groups) times the
schedule's factor, as the host ``LambdaLR`` computes it. On a GPU, with batches of one shape on
the device (``data.device_resident`` and ``data.static_shapes``), the step is recorded once in a
CUDA graph (``torch.cuda.graph``) and replayed: one launch per step instead of ~800, and new
dropout masks every replay (the default CUDA generator's offset advances with each replay; the
fused Triton attention draws its dropout seed there too). With ``model.freeze_backbone_steps``
the frozen and the unfrozen phase each record their own graph (they update different
parameters). Other batches (varying shapes, a CPU) are stepped as they come by the same
function, on CPU with the eager forward unless the model was switched to the one a GPU records
(:meth:`~graphormer_urpe.nn.graphormer.Graphormer.use_static_shapes`; the tests do, to check it
for host reads and data-dependent shapes). With ``model.compile`` the backbone's compiled regions
run inside the step (compiled during the steps before the recording).

The step takes what it needs from its LightningModule as one :class:`StepSpec` (the network, the
loss, the schedule and the data's ``static_shapes``), which the module builds when training
starts, and the phase of ``model.freeze_backbone_steps`` with each batch.

Lightning stays in charge of everything else, in its ordinary automatic optimization: the
engine runs inside the module's optimizer-step hook (:class:`~.module.OwnStepHooks`), so
``global_step``, the host ``LambdaLR`` (whose learning rate the learning-rate monitor and the
checkpoints record), checkpoints (an ordinary AdamW state dict; one written inside an
accumulation cycle also holds what its batches summed, :meth:`TrainingEngine.accumulated`, so a
resume continues the cycle), exact resume (the loader
restarts mid-epoch), validation and callbacks all work as for any Lightning run. (Lightning's
manual optimization would refuse ``trainer.gradient_clip_val`` and count ``global_step`` in
another progress tracker than the automatic loop.) Losses and skipped steps are read from the device every
``trainer.log_every_n_steps`` (one sync per interval), logged as ``train/loss`` (mean of the
interval's finite losses) and ``train/skipped_steps`` (total); an interval in which every step
was skipped stops training with a ``FloatingPointError``, and since skipped steps change nothing,
no checkpoint ever holds a diverged model. What a run asks for beyond the step (clipping by
value, sharded strategies) :meth:`TrainingEngine.unsupported` names before it trains.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from graphormer_urpe.data.batch import GraphBatch
from graphormer_urpe.data.resident import OrderSlice, ResidentSplit
from graphormer_urpe.utils.lightning_private import logs_due
from graphormer_urpe.training.schedule import relative_lr

log = logging.getLogger(__name__)
#: Untimed, update-free steps before a CUDA graph is recorded (they initialise the optimizer
#: state and let cuDNN / cuBLAS pick their kernels outside the capture).
CAPTURE_WARMUP_STEPS = 3


@dataclass(frozen=True)
class StepSpec:
    """What the training step takes from its LightningModule, built by the module's
    ``step_spec()`` when training starts (its schedule and training batches are known then):
    the network (batch -> outputs), the loss (:meth:`~graphormer_urpe.data.task.Task.loss_terms`:
    outputs, targets -> mean loss over the labelled targets, their number), the schedule
    (:func:`~.schedule.relative_lr`'s arguments after the update number), and ``static_shapes``:
    with the data's option of that name on device-resident data, the training split, whose
    batches of one shape come as :class:`OrderSlice` and are gathered by the step itself (inside
    its recorded graph on a GPU); None: batches come gathered, of any shape."""

    model: nn.Module
    loss_terms: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]
    schedule: tuple[int, int, float, float]
    static_shapes: ResidentSplit | None = None


class StepCounts:
    """What the steps of an interval did, counted on the device at fixed addresses (a recorded
    graph updates them): the loss sum of the applied steps, the applied and the skipped steps,
    and of those skipped, the ones a loss scaler skipped for an overflow. Read once per logging
    interval."""

    def __init__(self, device: torch.device) -> None:
        self.loss_sum, self.applied, self.skipped, self.overflows = (
            torch.zeros((), dtype=torch.float64, device=device) for _ in range(4))

    def tensors(self) -> tuple[Tensor, ...]:
        return self.loss_sum, self.applied, self.skipped, self.overflows

    def read(self) -> tuple[float, float, float, float]:
        """``(loss sum, applied, skipped, overflows)``: one device-to-host copy."""
        return tuple(torch.stack(self.tensors()).tolist())

    def reset(self) -> None:
        for t in self.tensors():
            t.zero_()


class LossScale:
    """fp16's dynamic loss scale (``torch.amp.GradScaler``'s rule) on the device: the loss is
    multiplied by ``scale`` before backward; after an update whose gradients overflowed
    (non-finite) the update is skipped and the scale multiplied by ``backoff``; after ``interval``
    updates in a row without one, by ``growth``. Device tensors only, so a recorded step holds it;
    :meth:`state_dict` goes into the checkpoint."""

    def __init__(self, device: torch.device, scale: float = 2.0**16, growth: float = 2.0,
                 backoff: float = 0.5, interval: int = 2000) -> None:
        self.scale = torch.full((), float(scale), dtype=torch.float32, device=device)
        self.good_steps = torch.zeros((), dtype=torch.int32, device=device)
        self.growth, self.backoff, self.interval = float(growth), float(backoff), int(interval)

    @classmethod
    def like(cls, scaler: torch.amp.GradScaler, device: torch.device) -> "LossScale":
        """The scale that ``scaler`` (Lightning's, of ``16-mixed``) would keep, its settings read
        through its public getters."""
        return cls(device, scaler.get_scale(), scaler.get_growth_factor(), scaler.get_backoff_factor(),
                   scaler.get_growth_interval())

    def update(self, overflow: Tensor, counts: Tensor) -> None:
        """After an update: ``overflow`` (bool tensor) says whether its gradients were non-finite;
        nothing changes unless ``counts`` (bool tensor; False for an update-free warmup step)."""
        good = torch.where(overflow, 0, self.good_steps + 1)
        grow = good >= self.interval
        scale = torch.where(overflow, self.scale * self.backoff,
                            torch.where(grow, self.scale * self.growth, self.scale))
        self.scale.copy_(torch.where(counts, scale, self.scale))
        self.good_steps.copy_(torch.where(counts, torch.where(grow, 0, good), self.good_steps))

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": float(self.scale), "good_steps": int(self.good_steps)}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale.fill_(float(state["scale"]))
        self.good_steps.fill_(int(state["good_steps"]))


def optimizer_update(optimizer: torch.optim.Optimizer, grads: Sequence[Tensor], loss: Tensor,
                     clip: float, counts: StepCounts, lrs: Sequence[Tensor], force_skip: Tensor,
                     unscale: Tensor | None = None, loss_scale: LossScale | None = None) -> None:
    """The update after backward: the gradients ``grads`` multiplied by ``unscale`` (where given:
    from a sum over several batches, or a scaled loss, to the gradient of the mean loss) and
    clipped to total norm ``clip`` (``torch.nn.utils.clip_grad_norm_``'s arithmetic: foreach
    norms, the norm of those, one scale; both factors in one multiplication), then the
    optimizer's step, skipped (parameters, moments and step counts untouched: the fused AdamW's
    ``optimizer.found_inf``) if the loss or the gradient norm is not finite or ``force_skip`` is
    1, then the counts and ``loss_scale``'s update. ``loss``: the mean loss of the step;
    ``lrs``: a device learning rate per param group for this step (a recorded graph reads them).
    Device work only: no host sync, fixed shapes."""
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    factor = unscale
    if unscale is not None:
        norm = norm * unscale
    if clip > 0:
        clip_factor = (clip / (norm + 1e-6)).clamp(max=1.0)
        factor = clip_factor if factor is None else factor * clip_factor
    if factor is not None:
        torch._foreach_mul_(grads, factor)
    loss = loss.detach()
    finite_loss, finite_norm = torch.isfinite(loss), torch.isfinite(norm)
    finite = finite_loss & finite_norm & (force_skip == 0)
    optimizer.found_inf.copy_((~finite).float())
    groups = optimizer.param_groups
    host_lrs = [group["lr"] for group in groups]
    for group, lr in zip(groups, lrs):
        group["lr"] = lr
    try:
        optimizer.step()
    finally:
        for group, lr in zip(groups, host_lrs):
            group["lr"] = lr
    counts.loss_sum.add_(torch.where(finite, loss.double(), 0.0))
    counts.applied.add_(finite.double())
    counts.skipped.add_(1.0 - finite.double())
    if loss_scale is not None:
        # a finite loss whose scaled gradients overflowed: the scaler's business, not a divergence;
        # the scale backs off after any non-finite step, as GradScaler's (which sees the gradients)
        counted = force_skip == 0
        counts.overflows.add_((finite_loss & ~finite_norm & counted).double())
        loss_scale.update(~(finite_loss & finite_norm), counted)


def record_step(step: Callable[[], None], force_skip: Tensor, counts: StepCounts,
                warmup: int = CAPTURE_WARMUP_STEPS) -> torch.cuda.CUDAGraph:
    """``step`` (device work only, on fixed buffers; it passes ``force_skip`` to
    :func:`optimizer_update`) recorded in a CUDA graph. Before it, ``warmup`` update-free runs on a
    side stream (``force_skip`` 1: they initialise the optimizer state and let cuDNN / cuBLAS pick
    their kernels outside the capture); the interval's ``counts`` and the CUDA random state are
    kept as they were."""
    kept = [stat.clone() for stat in counts.tensors()]
    # The warmup's dropout draws are given back: a run that records its step again (a resumed
    # one) continues on the random stream of one that recorded it once.
    rng = torch.cuda.get_rng_state()
    force_skip.fill_(1.0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.set_rng_state(rng)
    force_skip.fill_(0.0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for stat, value in zip(counts.tensors(), kept):
        stat.copy_(value)
    return graph


class TrainingEngine(pl.Callback):
    """The whole optimizer step, on the device, of a module with :class:`~.module.OwnStepHooks`;
    see the module docstring. Also a Lightning callback: when training starts it takes the
    module's :class:`StepSpec` and the run's settings, and it reports the device-side statistics
    at each logging interval."""

    def __init__(self) -> None:
        #: What the step takes from the module (:class:`StepSpec`), from when training starts.
        self.spec: StepSpec | None = None
        self._ready = False
        #: One recorded step per phase of ``freeze_backbone_steps`` (frozen or not): the two
        #: phases update different parameters.
        self._graphs: dict[bool, torch.cuda.CUDAGraph] = {}
        self._order_source: Tensor | None = None
        self._host_updates = -1  # the update count the device counter holds
        self.total_skipped = 0
        self.total_applied = 0  # of this fit, as read at the reports
        #: Set (by the module's optimizer-step hook, :class:`~.module.OwnStepHooks`) while the
        #: batch in progress ends with an optimizer update; unset while it only accumulates.
        self.updating = False
        self._cycle_start = True  # the next batch starts a new sum of gradients
        #: fp16's loss scale (``16-mixed``), and the one of the checkpoint a fit resumes
        self.loss_scale: LossScale | None = None
        self.resumed_loss_scale: dict | None = None
        #: The accumulation cycle in progress in the checkpoint a fit resumes
        #: (:meth:`accumulated`), continued by the first batch
        self.resumed_accumulation: dict | None = None

    # Settings ------------------------------------------------------------------------------------
    @staticmethod
    def unsupported(trainer: pl.Trainer) -> list[str]:
        """What the trainer's settings ask for that the engine does not do, as the settings it needs."""
        problems = []
        if trainer.gradient_clip_val and (trainer.gradient_clip_algorithm or "norm") != "norm":
            problems.append("clipping by norm (trainer.gradient_clip_algorithm norm)")
        strategy = trainer.strategy
        if not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)) or isinstance(strategy, DeepSpeedStrategy):
            problems.append(f"one device or DDP (trainer.strategy ddp; got {type(strategy).__name__}, whose "
                            "sharded parameters or own optimizer step the training step does not serve)")
        return problems

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.spec, self.device = pl_module.step_spec(), pl_module.device
        if self.spec.static_shapes is None and self.device.type == "cuda":
            log.warning("engine: the training batches vary in shape, so each step runs without a "
                        "CUDA graph; data.init_args.device_resident true and static_shapes true let "
                        "it record the step once")
        self.clip = float(trainer.gradient_clip_val or 0.0)
        self.processes = trainer.world_size
        self.accumulates = trainer.accumulate_grad_batches > 1 or any(
            isinstance(callback, GradientAccumulationScheduler) for callback in trainer.callbacks)
        #: The gradients are summed over the labelled targets of several batches (processes,
        #: accumulation) and divided by their number at the update: the mean of the global batch.
        self.weighted = self.processes > 1 or self.accumulates
        if isinstance(trainer.strategy.model, DistributedDataParallel):
            # DDP's own reducer would arm itself after this step's backward (run inside its
            # forward) and catch the next one; the step averages the gradients itself.
            trainer.strategy.model.require_backward_grad_sync = False
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.loss_scale = LossScale.like(scaler, self.device) if scaler is not None else None
        if self.loss_scale is not None and self.resumed_loss_scale is not None:
            self.loss_scale.load_state_dict(self.resumed_loss_scale)
        self.resumed_loss_scale = None
        # a new fit: a new optimizer, and the device's update count taken from the trainer again
        self._ready, self._graphs, self._order_source, self._host_updates = False, {}, None, -1
        self._cycle_start = True
        self.total_applied = 0

    # The step ------------------------------------------------------------------------------------
    def _build(self, trainer: pl.Trainer, part: OrderSlice | None) -> None:
        """Static buffers (the same tensors every step, so a recorded graph can read them); the
        epoch order's with batches of one shape (``part``)."""
        device, split = self.device, self.spec.static_shapes
        self.optimizer = trainer.optimizers[0]
        self.params = [p for group in self.optimizer.param_groups for p in group["params"]]
        zero = lambda dtype=torch.float32: torch.zeros((), dtype=dtype, device=device)  # noqa: E731
        if part is not None:
            self.order = torch.empty_like(part.order)
            self.start = zero(torch.int64)
            self.offsets = torch.arange(part.size, device=device)
        self.updates = zero(torch.float64)  # optimizer updates done (u)
        # One learning rate per param group: its peak (the LambdaLR's base lr: model.lr, or
        # model.head_lr for the head's groups) times the schedule's factor. The fused kernel reads
        # a tensor lr as float32 on a GPU and as a double on CPU (there, the host schedule's lr to
        # the bit).
        lr_dtype = torch.float32 if device.type == "cuda" else torch.float64
        self.peak_lrs = [float(group.get("initial_lr", group["lr"])) for group in self.optimizer.param_groups]
        self.lrs = [zero(lr_dtype) for _ in self.peak_lrs]
        self.found_inf = zero()  # 1.0: skip this update (fused AdamW's found_inf contract)
        self.force_skip = zero()  # 1.0 while warming up before a capture
        self.loss = zero()
        # The update's loss: the sum of (mean loss x weight) over its batches, and of the weights
        # (their labelled targets where the gradients are weighted, else 1).
        self.loss_total, self.weights = zero(), zero()
        self.counts = StepCounts(device)
        self.optimizer.found_inf = self.found_inf
        if part is not None and device.type == "cuda":  # what a CUDA graph holds; ids checked once
            self.spec.model.use_static_shapes(split.graphs.x, split.graphs.edge_attr)
        self._ready = True
        if self.resumed_accumulation is not None:
            self._continue_cycle(self.resumed_accumulation)
            self.resumed_accumulation = None

    def accumulated(self) -> dict | None:
        """Inside an accumulation cycle (a validation between its batches saves a checkpoint
        there), what its batches have summed so far: the gradients, in the optimizer's parameter
        order (None where a parameter has none), the loss sum and the weights, as CPU tensors for
        a checkpoint; None at a cycle's end, where the optimizer's state is the whole state."""
        if not self._ready or self._cycle_start:
            return None
        return {"gradients": [None if p.grad is None else p.grad.detach().cpu().clone() for p in self.params],
                "loss_total": self.loss_total.detach().cpu().clone(), "weights": self.weights.detach().cpu().clone()}

    def _continue_cycle(self, state: dict) -> None:
        """Resume inside the accumulation cycle that :meth:`accumulated` saved: the next batch adds
        to its sums instead of starting new ones."""
        if len(state["gradients"]) != len(self.params):
            raise ValueError(f"the checkpoint's accumulated gradients are of {len(state['gradients'])} "
                             f"parameters, the model has {len(self.params)}")
        for param, grad in zip(self.params, state["gradients"]):
            param.grad = None if grad is None else grad.to(param.device, param.dtype)
        self.loss_total.copy_(state["loss_total"])
        self.weights.copy_(state["weights"])
        self._cycle_start = False

    def _capture(self, trainer: pl.Trainer, part: OrderSlice) -> torch.cuda.CUDAGraph:
        """The step recorded in a CUDA graph (:func:`record_step`) on the batch of ``part``."""
        self._feed(trainer, part)
        graph = record_step(self._step, self.force_skip, self.counts)
        self._host_updates = -1  # the warmup advanced the device counter
        return graph

    def _step(self, batch: GraphBatch | None = None, update: bool = True) -> None:
        """One batch on ``batch``, or (None) on the batch gathered from the epoch order: forward
        and backward, adding to the gradients, then (``update``) the optimizer step; device-side
        only (recorded as is into a CUDA graph)."""
        spec = self.spec
        if batch is None:
            batch = spec.static_shapes.gather(self.order, self.start, self.offsets)
        if self._cycle_start:
            # Freed, not zeroed: backward then hands each gradient over without a kernel (zeroing
            # in place would add a zero and an add per parameter). In a recorded graph the
            # gradients live in the graph's memory pool, so every replay writes them at the same
            # addresses.
            self.optimizer.zero_grad(set_to_none=True)
            self.loss_total.zero_()
            self.weights.zero_()
        device = self.loss.device.type
        # Under Lightning's autocast (it wraps training_step), without the cast cache: a recorded
        # graph cannot keep one.
        autocast = (torch.autocast(device, dtype=torch.get_autocast_dtype(device), cache_enabled=False)
                    if torch.is_autocast_enabled(device) else contextlib.nullcontext())
        with autocast:
            mean, count = spec.loss_terms(spec.model(batch), batch.y)
        # Weighted: the sum over the labelled targets, divided by the global batch's at the update.
        weight = count if self.weighted else 1.0
        objective = mean * weight if self.weighted else mean
        if self.loss_scale is not None:
            objective = objective * self.loss_scale.scale
        objective.backward()
        self.loss_total.add_(mean.detach() * weight)
        self.weights.add_(weight)
        if update:
            self._update()

    def _update(self) -> None:
        """The optimizer update on the summed gradients: averaged across the processes (one
        all-reduce of one flat buffer: every gradient, the loss and the weights), divided by
        the labelled targets of the global batch and the loss scale, clipped by their global
        norm, applied or skipped alike on every process (:func:`optimizer_update`)."""
        if self.processes > 1:
            grads = []
            for p in self.params:
                if p.requires_grad:
                    if p.grad is None:  # unused by this batch, maybe not by another process's
                        p.grad = torch.zeros_like(p)
                    grads.append(p.grad)
            dtype = grads[0].dtype
            flat = torch.cat([g.reshape(-1) for g in grads]
                             + [self.loss_total.reshape(1).to(dtype), self.weights.reshape(1).to(dtype)])
            torch.distributed.all_reduce(flat)
            parts = flat.split([g.numel() for g in grads] + [1, 1])
            torch._foreach_copy_(grads, [part.view_as(g) for part, g in zip(parts, grads)])
            self.loss_total.copy_(parts[-2].reshape(()))
            self.weights.copy_(parts[-1].reshape(()))
        else:
            grads = [p.grad for p in self.params if p.grad is not None]
        weights = self.weights.clamp(min=1.0)
        loss = self.loss_total / weights
        unscale = 1.0 / weights if self.weighted else None
        if self.loss_scale is not None:
            unscale = (1.0 if unscale is None else unscale) / self.loss_scale.scale
        factor = relative_lr(self.updates + 1, *self.spec.schedule)
        for lr, peak in zip(self.lrs, self.peak_lrs):
            lr.copy_(peak * factor)
        # Lightning's gradient_clip_val, on the parameters that have gradients (not the frozen
        # backbone's): clip_grad_norm_'s arithmetic.
        optimizer_update(self.optimizer, grads, loss, self.clip, self.counts, self.lrs,
                         self.force_skip, unscale, self.loss_scale)
        self.updates.add_(1)
        self.loss.copy_(loss)

    def _feed(self, trainer: pl.Trainer, part: OrderSlice | None) -> None:
        """The step's inputs: the epoch order (once per epoch) and the batch start of ``part``,
        and the update count after a resume (host values, copied without a sync)."""
        if part is not None:
            if part.order is not self._order_source:
                self.order.copy_(part.order)
                self._order_source = part.order
            self.start.fill_(part.start)
        if self._host_updates != trainer.global_step:
            self.updates.fill_(trainer.global_step)
        self._host_updates = trainer.global_step + int(self.updating)

    def training_step(self, batch: OrderSlice | GraphBatch, trainer: pl.Trainer, frozen: bool) -> Tensor:
        """Run one batch of ``batch`` (a :class:`OrderSlice` to gather, or a gathered batch):
        the whole optimizer step, or, while Lightning accumulates, its forward and backward;
        the loss of the last update (a device tensor, not read here). ``frozen``: the module
        trains the head alone (``model.freeze_backbone_steps``), a phase with its own graph."""
        part = batch if self.spec.static_shapes is not None else None
        if not self._ready:
            self._build(trainer, part)
        # A recorded graph is one whole update; accumulation's batches are stepped as they come.
        records = part is not None and part.order.device.type == "cuda" and not self.accumulates
        if records and frozen not in self._graphs:
            self._graphs[frozen] = self._capture(trainer, part)
        self._feed(trainer, part)
        if frozen in self._graphs:
            self._graphs[frozen].replay()
        else:
            self._step(None if part is not None else batch, update=self.updating)
        self._cycle_start = self.updating
        return self.loss

    # Reporting -----------------------------------------------------------------------------------
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch,
                           batch_idx: int) -> None:
        # after an update only: batches that accumulate count nothing (Lightning's log interval
        # counts updates, so it stays due over an accumulation cycle)
        if self._ready and self._cycle_start and logs_due(trainer):
            self.report(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.check(trainer)

    def check(self, trainer: pl.Trainer) -> None:
        """FloatingPointError if every step since the last report was skipped for a non-finite
        loss or gradient (not a loss scaler's overflow) and they make a whole logging interval
        (one read of the device counters): before a checkpoint is written and when training
        ends, so a run whose every step diverges stops instead of saving its unchanged model as
        if it trained, while a stop right after a report with one skipped step (a time slice's
        end) saves as usual once this fit has applied a step."""
        if not self._ready:
            return
        _, applied, skipped, overflows = self.counts.read()
        diverged = skipped - overflows
        whole = diverged >= trainer.log_every_n_steps or self.total_applied == 0
        if diverged and not applied and not overflows and whole:
            self._diverged(int(diverged), trainer)

    @staticmethod
    def _diverged(skipped: int, trainer: pl.Trainer) -> None:
        raise FloatingPointError(
            f"every training step of the last {skipped} had a non-finite loss or gradient (up to "
            f"step {trainer.global_step}); no update was applied and no checkpoint "
            "holds a diverged model: check the targets for huge values and lower the learning rate")

    def report(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, float]:
        """Read and reset the interval's statistics (one device-to-host copy), log them (through
        ``pl_module``), and raise
        FloatingPointError if every step of the interval was skipped for a non-finite loss or
        gradient."""
        loss_sum, finite, skipped, overflows = self.counts.read()
        self.counts.reset()
        self.total_skipped += int(skipped)
        self.total_applied += int(finite)
        if skipped - overflows:
            log.warning("engine: skipped %d of the last %d steps (non-finite loss or gradient) before "
                        "step %d; %d skipped in all", skipped - overflows, finite + skipped,
                        trainer.global_step, self.total_skipped)
            if not finite and not overflows:
                self._diverged(int(skipped), trainer)
        stats = {"train/skipped_steps": float(self.total_skipped)}
        if finite:
            stats["train/loss"] = loss_sum / finite
        if self.loss_scale is not None:
            stats["train/loss_scale"] = float(self.loss_scale.scale)
        pl_module.log_dict(stats, batch_size=trainer.train_dataloader.batch_size, prog_bar=True)
        return stats

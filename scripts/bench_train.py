"""Training throughput: steps/s and graphs/s of the real training loop, eager vs the GPU paths.

For each preset (ZINC-12k train graphs with ``slim``; PCQM4Mv2 molecules with ``base``, or with
``small``, the paper's PCQM4M model, as ``pcqm4mv2-small``), each
attention (``urpe``, ``rpe``: plain Graphormer) and each path (:data:`PATHS`):

* ``eager``: ``DataLoader`` (numpy collation on the host, ``--num-workers`` processes), float32,
  no compile, the reference attention kernel (``attention_impl="eager"``);
* ``compiled`` (``configs/compiled.yaml``): device-resident data (``device_resident=True``), ``compile=True``
  (``torch.compile(dynamic=True)``), ``--compiled-precision`` (default ``bf16-mixed``) and, on CUDA,
  the fused Triton attention (``attention_impl="triton"``);
* ``bucketed``: ``eager`` on batches of similar-sized graphs (``bucket_batches=16``: less
  padding);
* ``resident``: device-resident data and, on CUDA, the Triton attention, float32, no compile;
* ``engine``: device-resident batches of one shape (``static_shapes=True``) gathered inside the
  training step (:mod:`graphormer_urpe.training.engine`), the whole optimizer step (gather,
  forward, backward, clipping, fused AdamW) recorded in one CUDA graph on a GPU, float32 with TF32 matmuls (``matmul_precision="high"``), the eager attention core; on CPU
  the same step run eagerly, as a GPU records it (``static_shapes``);
* ``engine-triton``: ``engine`` with the fused Triton attention core on CUDA;
* ``engine-compiled``: ``engine`` with the compiled backbone (``compile=True``) inside the step,
  inductor's kernels recorded in the same CUDA graph;
* ``engine-compiled-triton``: ``engine-compiled`` with the fused Triton attention core on CUDA
  (it runs between the compiled regions, inside the recorded step);
* ``engine-compiled-static``: ``engine-compiled`` compiled for the batches' one shape
  (``dynamic=False``) instead of symbolic sizes: inductor may then pick kernels for the known
  number of keys (a measurement; ``model.compile`` keeps symbolic sizes, so that validation
  batches of other sizes reuse one graph);

it runs ``--warmup`` + ``--steps`` optimizer steps of a Lightning ``Trainer`` (AdamW, gradient
clipping 5.0, as in the configs; no validation, logging or checkpoints) and times only the last
``--steps`` (``torch.cuda.synchronize()`` at both ends on GPU; the warmup covers compilation).
The URPE/RPE time ratio per preset and path is the cost of URPE (target on GPU: <= 1.05).
A row that fails records its error (type and first line) and the benchmark goes on.

``--count-ops P`` profiles ``P`` more steps after the timed ones (``torch.profiler``), lists the
operators that take the most device time (CUDA kernels on a GPU) and reports ``ops_per_step``:
the leaf ATen operators per optimizer step (those that call no other ATen operator), less those
that only make views or allocate
(:data:`NO_KERNEL_OPS`): about one kernel launch each on a GPU. With ``--width`` (hidden and
FFN width; the preset's depth and heads are kept) the CPU's ms per step is then mostly host time.
On a CPU it also reports ``traffic_mb_per_step``: the bytes the step's operators read and write
(:class:`TrafficCounter`; the CPU's dropout takes five operators per mask where a GPU runs one
kernel, so it counts a little more than a GPU moves). These are the CPU proxies for the launch- and
memory-bound GPU step; on a GPU, ``steps_per_s`` is the figure. On CPU, neither sees inside a
compiled backbone (``compiled``, ``engine-compiled``): its operators count only what runs outside
the compiled regions, and its traffic is not counted.

Data: ZINC-12k from ``--zinc-root`` (built from ``--shared``/zinc when missing, as
``ZINCDataModule(source_dir=...)`` does); PCQM4Mv2 from an OGB-format root written by
``ogb_lsc.write_root`` from the 1,999 real molecules in ``--shared``/pcqm4mv2 (the real size
distribution). A "data only" table times one epoch of batches of each loader kind.

Prints tables, then one JSON line (device, torch version, date, every row, the ratios).
``--device cpu`` (automatic without CUDA) uses small step counts and batches so it runs in
minutes on a laptop-class CPU; the numbers then say nothing about GPU speed.
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from graphormer_urpe.data.facts import DataFacts
from graphormer_urpe.data.local_data import local_data_dir
from graphormer_urpe.nn.dropout import CPU_DROPOUT

REPO = Path(__file__).resolve().parents[1]
#: benchmark name -> (data set, backbone preset)
PRESET_DATA = {"zinc": ("zinc", "slim"), "pcqm4mv2": ("pcqm4mv2", "base"), "pcqm4mv2-small": ("pcqm4mv2", "small")}
#: (warmup, steps, ZINC batch, PCQM4Mv2 batch) per device kind; GPU batches are the configs'.
DEFAULTS = {"cuda": (30, 200, 64, 256), "cpu": (3, 10, 32, 8)}


@dataclass(frozen=True)
class TrainPath:
    """How one benchmark row trains (``precision`` None: ``--compiled-precision``)."""

    resident: bool
    compile: bool = False
    precision: str | None = "32-true"
    triton: bool = False  # the fused attention on CUDA (eager on CPU)
    static_shapes: bool = False
    matmul_precision: str | None = None
    bucket_batches: int = 0
    static_compile: bool = False  # compiled for the first batch's shape (dynamic=False)


PATHS = {
    "eager": TrainPath(resident=False),
    "bucketed": TrainPath(resident=False, bucket_batches=16),
    "compiled": TrainPath(resident=True, compile=True, precision=None, triton=True),
    "resident": TrainPath(resident=True, triton=True),
    "engine": TrainPath(resident=True, static_shapes=True, matmul_precision="high"),
    "engine-triton": TrainPath(resident=True, static_shapes=True, triton=True, matmul_precision="high"),
    "engine-compiled": TrainPath(resident=True, static_shapes=True, compile=True, matmul_precision="high"),
    "engine-compiled-triton": TrainPath(resident=True, static_shapes=True, compile=True, triton=True,
                                        matmul_precision="high"),
    "engine-compiled-static": TrainPath(resident=True, static_shapes=True, compile=True,
                                        static_compile=True, matmul_precision="high"),
}
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")


def path_spec(path: str) -> TrainPath:
    """A ``--paths`` entry: a name of :data:`PATHS`, optionally with another Lightning precision
    as ``NAME@PRECISION`` (e.g. ``compiled@32-true``, ``resident@bf16-mixed``)."""
    name, _, precision = path.partition("@")
    if name not in PATHS or (precision and precision not in PRECISIONS):
        raise ValueError(f"unknown path {path!r}: use NAME or NAME@PRECISION with NAME in {list(PATHS)} "
                         f"and PRECISION in {list(PRECISIONS)}")
    spec = PATHS[name]
    return TrainPath(**{**spec.__dict__, "precision": precision}) if precision else spec


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")),
                 platform.processor())
    return f"{model}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}"


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def make_step_timer(device: str, warmup: int, steps: int):
    from lightning.pytorch.callbacks import Callback

    class StepTimer(Callback):
        """Wall time and graphs of optimizer steps ``warmup + 1 .. warmup + steps``."""

        def __init__(self) -> None:
            self.run_start = time.perf_counter()
            self.start = self.end = None
            self.graphs = 0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if trainer.global_step == warmup and self.start is None:
                synchronize(device)
                self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if self.start is not None and self.end is None:
                self.graphs += batch.num_graphs
                if trainer.global_step == warmup + steps:
                    synchronize(device)
                    self.end = time.perf_counter()

    return StepTimer()


#: ATen operators that only make tensor metadata, allocate or read a scalar (no kernel on a GPU).
NO_KERNEL_OPS = frozenset(f"aten::{name}" for name in (
    "empty", "empty_strided", "empty_like", "as_strided", "view", "_reshape_alias", "_unsafe_view",
    "reshape", "expand", "expand_as", "t", "transpose", "permute", "slice", "select", "unsqueeze",
    "squeeze", "detach", "alias", "lift_fresh", "resolve_conj", "resolve_neg", "unbind", "split",
    "split_with_sizes", "chunk", "narrow", "set_", "result_type", "size", "stride", "resize_",
    "view_as", "unflatten", "flatten", "_has_compatible_shallow_copy_type", "is_nonzero", "to",
    "_local_scalar_dense"))


#: Operators that run as one kernel (or one multi-tensor launch) on a GPU but as a loop of
#: smaller operators on a CPU: each counts once, its CPU operators not.
ONE_GPU_KERNEL = ("aten::_foreach_", "aten::_fused_", "aten::native_dropout", "aten::bernoulli", CPU_DROPOUT)


#: Operators listed per row by ``--count-ops`` (where the device time goes).
TOP_OPS = 12


def kernel_ops(events) -> int:
    """The profiler events that launch a kernel on a GPU, roughly: ATen operators that call no
    other ATen operator, less :data:`NO_KERNEL_OPS`, with :data:`ONE_GPU_KERNEL` operators counted
    once each instead of their CPU parts."""
    def inside_one_kernel(event) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if parent.name.startswith(ONE_GPU_KERNEL):
                return True
            parent = parent.cpu_parent
        return False

    count = 0
    for event in events:
        if event.name in NO_KERNEL_OPS or inside_one_kernel(event):
            continue
        if event.name.startswith(ONE_GPU_KERNEL):
            count += 1
        elif event.name.startswith("aten::") and not any(child.name.startswith("aten::")
                                                         for child in event.cpu_children):
            count += 1
    return count


def device_work(profiler, device: str, steps: int, count: int = TOP_OPS) -> tuple[list[dict], dict]:
    """Where the device time of ``steps`` profiled steps goes: CUDA kernels by GPU time on a GPU,
    ATen operators by self CPU time on a CPU. Returns the ``count`` costliest (ms per step and
    calls per step, most first) and their sum over all of them: on a GPU, the time its kernels
    kept it busy per step, to set against the step's wall time."""
    from torch.autograd import DeviceType

    if device == "cuda":
        events = [e for e in profiler.key_averages() if e.device_type == DeviceType.CUDA]
        time_us = lambda e: e.self_device_time_total  # noqa: E731
    else:
        events = [e for e in profiler.key_averages() if e.key.startswith("aten::")]
        time_us = lambda e: e.self_cpu_time_total  # noqa: E731
    events.sort(key=time_us, reverse=True)
    top = [{"name": e.key[:90], "ms_per_step": round(time_us(e) / 1000 / steps, 3),
            "calls_per_step": round(e.count / steps, 1)} for e in events[:count]]
    total = {"ms_per_step": round(sum(map(time_us, events)) / 1000 / steps, 3),
             "calls_per_step": round(sum(e.count for e in events) / steps, 1)}
    return top, total


def print_top_ops(row: dict, device: str) -> None:
    """The row's :func:`device_work`, as soon as it is measured (a run stopped later keeps them)."""
    if row.get("top_ops"):
        total = row["device_total"]
        print(f"    where the time goes ({'GPU kernels' if device == 'cuda' else 'ATen ops, self CPU time'}; "
              f"ms/step, calls/step; all: {total['ms_per_step']:.3f} ms in {total['calls_per_step']:,.0f} calls):")
        for op in row["top_ops"]:
            print(f"    {op['ms_per_step']:9.3f}  {op['calls_per_step']:7.1f}  {op['name']}", flush=True)


def tensor_bytes(value) -> int:
    """Bytes of a tensor's elements, at most its storage's (an expanded tensor is read once)."""
    if not isinstance(value, torch.Tensor):
        return 0
    return min(value.numel() * value.element_size(), value.untyped_storage().nbytes())


class TrafficCounter(TorchDispatchMode):
    """Counts the bytes operators read and write: every tensor argument once and every result
    once (an in-place operator reads and writes its tensor), skipping operators that only make
    views or allocate (:data:`NO_KERNEL_OPS`). Below autograd, so the backward counts too; a
    replayed CUDA graph dispatches nothing, so it counts on CPU only."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        returns = func._schema.returns
        makes_view = bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write
        if not makes_view and f"aten::{func._overloadpacket.__name__}" not in NO_KERNEL_OPS:
            self.bytes += sum(map(tensor_bytes, tree_leaves((args, kwargs, result))))
        return result


def make_op_counter(start: int, steps: int, device: str, compiled: bool = False, top: int = TOP_OPS):
    """A callback profiling optimizer steps ``start + 1 .. start + steps``; its ``ops_per_step``
    counts the leaf ATen operators per step and ``top_ops`` and ``device_total`` say where the
    device time goes (:func:`device_work`; on a GPU the kernels of a replayed CUDA graph are
    recorded too). On a CPU it
    then counts one more step's memory traffic (:class:`TrafficCounter`, ``traffic_mb_per_step``):
    apart from the profiled ones, since operators dispatched through Python show the profiler
    more events; not for a ``compiled`` backbone, whose compiled code a dispatch mode bypasses.
    ``extra_steps`` is how many steps it needs after ``start``."""
    import lightning.pytorch as pl
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])

    class OpCounter(pl.Callback):
        extra_steps = steps + (device == "cpu" and not compiled)

        def __init__(self) -> None:
            self.profiler, self.ops_per_step, self.top_ops, self.device_total = None, None, None, None
            self.traffic, self.traffic_mb_per_step = None, None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if trainer.global_step == start and self.profiler is None:
                self.profiler = profile(activities=activities)
                self.profiler.__enter__()
            if trainer.global_step == start + steps and self.extra_steps > steps and self.traffic is None:
                self.traffic = TrafficCounter()
                self.traffic.__enter__()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if self.profiler is not None and self.ops_per_step is None and trainer.global_step == start + steps:
                if device == "cuda":
                    torch.cuda.synchronize()
                self.profiler.__exit__(None, None, None)
                self.ops_per_step = round(kernel_ops(self.profiler.events()) / steps, 1)
                self.top_ops, self.device_total = device_work(self.profiler, device, steps, top)
            if self.traffic is not None and self.traffic_mb_per_step is None and trainer.global_step == start + steps + 1:
                self.traffic.__exit__(None, None, None)
                self.traffic_mb_per_step = round(self.traffic.bytes / 1e6, 1)

    return OpCounter()


def batch_size_of(name: str, args) -> int:
    """The batch size of preset ``name``: ``--zinc-batch`` or ``--pcqm-batch`` by its data set."""
    return args.zinc_batch if PRESET_DATA[name][0] == "zinc" else args.pcqm_batch


def datamodule(name: str, args, batch_size: int, resident: bool, static_shapes: bool = False,
               bucket_batches: int = 0):
    from graphormer_urpe.data import PCQM4Mv2DataModule, ZINCDataModule

    common = {"batch_size": batch_size, "device_resident": resident, "static_shapes": static_shapes,
              "bucket_batches": bucket_batches,
              "num_workers": 0 if resident else args.num_workers, "pin_memory": args.device == "cuda"}
    if PRESET_DATA[name][0] == "zinc":
        return ZINCDataModule(root=str(args.zinc_root), subset=True, source_dir=str(args.shared / "zinc"),
                              max_hops=args.zinc_hops, build_workers=args.build_workers, **common)
    return PCQM4Mv2DataModule(root=str(args.pcqm_root), build_workers=args.build_workers, **common)


def run_training(name: str, attention: str, path: str, args) -> dict:
    import lightning.pytorch as pl
    from torch._dynamo.utils import counters

    from graphormer_urpe.training.module import GraphormerModule, compile_backbone

    spec = path_spec(path)
    batch_size = batch_size_of(name, args)
    width = {"hidden_dim": args.width, "ffn_dim": args.width} if args.width else {}
    dm = datamodule(name, args, batch_size, resident=spec.resident, static_shapes=spec.static_shapes,
                    bucket_batches=spec.bucket_batches)
    dm.prepare_data()
    impl = "triton" if spec.triton and args.device == "cuda" else "eager"
    precision = spec.precision or args.compiled_precision
    pl.seed_everything(0, verbose=False)
    module = GraphormerModule(
        facts=DataFacts.of(dm),
        preset=PRESET_DATA[name][1], backbone={"attention": attention, "attention_impl": impl, **width},
        warmup_steps=10, total_steps=10 * (args.warmup + args.steps), compile=spec.compile,
        matmul_precision=spec.matmul_precision)
    if spec.static_shapes:  # on CPU too: the forward a GPU records
        graphs = dm.train_dataset().graphs
        module.model.use_static_shapes(graphs.x, graphs.edge_attr)
    if spec.static_compile:  # the training batches' one shape, not symbolic sizes
        compile_backbone(module.model, dynamic=False)
    timer = make_step_timer(args.device, args.warmup, args.steps)
    counter = (make_op_counter(args.warmup + args.steps, args.count_ops, args.device, spec.compile, args.top_ops)
               if args.count_ops else None)
    trainer = pl.Trainer(
        accelerator=args.device, devices=1, max_steps=args.warmup + args.steps + (counter.extra_steps if counter else 0),
        max_epochs=-1,
        precision=precision, gradient_clip_val=5.0, limit_val_batches=0, num_sanity_val_steps=0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[timer] + ([counter] if counter else []))
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    counters.clear()
    trainer.fit(module, datamodule=dm)
    if timer.end is None:
        raise RuntimeError(f"{name}/{attention}/{path}: training stopped before "
                           f"{args.warmup + args.steps} steps")
    seconds = timer.end - timer.start
    row = {
        "preset": "/".join(PRESET_DATA[name]), "attention": attention, "path": path,
        "attention_impl": impl, "precision": precision, "compile": spec.compile,
        "device_resident": spec.resident, "static_shapes": spec.static_shapes,
        "matmul_precision": spec.matmul_precision or "highest", "max_hops": dm.max_hops,
        "bucket_batches": spec.bucket_batches, "width": args.width,
        "batch_size": batch_size, "warmup_steps": args.warmup, "steps": args.steps,
        "warmup_s": round(timer.start - timer.run_start, 2), "seconds": round(seconds, 4),
        "ms_per_step": round(1000 * seconds / args.steps, 3),
        "steps_per_s": round(args.steps / seconds, 3), "graphs_per_s": round(timer.graphs / seconds, 1),
    }
    if counter is not None:
        row["ops_per_step"] = counter.ops_per_step
        row["top_ops"], row["device_total"] = counter.top_ops, counter.device_total
        if counter.traffic_mb_per_step is not None:
            row["traffic_mb_per_step"] = counter.traffic_mb_per_step
    if args.device == "cuda":
        row["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    if spec.compile:  # what torch.compile made of it (0 graphs: not compiled)
        row["compiled_graphs"] = counters["stats"]["unique_graphs"]
        row["graph_breaks"] = sum(counters["graph_break"].values())
        row["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"]
    return row


def run_row(name: str, attention: str, path: str, args) -> dict:
    """:func:`run_training`, or a row with the error (type and first line) if it fails; either
    way the next row starts clean (compiled code, matmul precision)."""
    try:
        return run_training(name, attention, path, args)
    except Exception as error:  # noqa: BLE001 - one failing variant must not lose the others
        first_line = (str(error).strip().splitlines() or [""])[0]
        return {"preset": "/".join(PRESET_DATA[name]), "attention": attention, "path": path,
                "error": f"{type(error).__name__}: {first_line}"[:300]}
    finally:
        torch._dynamo.reset()  # the next run compiles its own model from scratch
        torch.set_float32_matmul_precision("highest")
        if args.device == "cuda":
            torch.cuda.empty_cache()


def run_data_only(name: str, args) -> list[dict]:
    """One epoch of training batches, on the device, per loader kind (no model)."""
    from graphormer_urpe.data.dataset import SeededShuffleSampler
    from graphormer_urpe.data.resident import ResidentLoader, ResidentSplit

    rows = []
    batch_size = batch_size_of(name, args)
    for resident in (False, True):
        dm = datamodule(name, args, batch_size, resident=False)
        dm.setup("fit")
        loader = dm.train_dataloader()
        if resident:  # what a Trainer's train_dataloader() builds, on the benchmark's device
            dataset = dm.train_dataset()
            on_device = dataset.graphs.to(args.device)
            loader = ResidentLoader(ResidentSplit(dataset, on_device), batch_size,
                                    SeededShuffleSampler(len(dataset), dm.seed))
        for epoch in range(2):  # epoch 0 warms caches (and CUDA); epoch 1 is timed
            loader.sampler.set_epoch(epoch)
            synchronize(args.device)
            start = time.perf_counter()
            graphs = sum(batch.to(args.device, non_blocking=True).num_graphs for batch in loader)
            synchronize(args.device)
            seconds = time.perf_counter() - start
        kind = "resident" if resident else f"DataLoader(num_workers={args.num_workers})"
        rows.append({"preset": name, "loader": kind, "batch_size": batch_size, "batches": len(loader),
                     "graphs_per_s": round(graphs / seconds, 1)})
    return rows


def profile_calls(fn, calls: int, device: str, top: int, traffic: bool = True) -> dict:
    """``calls`` calls of ``fn`` under the profiler: where the device time goes
    (:func:`device_work`: ``top_ops``, ``device_total``) and, on a CPU, the :func:`kernel_ops`
    per call (``kernel_ops_per_step``; a GPU's replayed graph dispatches no operator to count)
    and, with ``traffic``, the bytes one more call's operators move (:class:`TrafficCounter`,
    ``traffic_mb_per_step``; not for compiled code, which a dispatch mode does not see)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        synchronize(device)
    top_ops, total = device_work(prof, device, calls, top)
    stats = {"top_ops": top_ops, "device_total": total}
    if device == "cpu":
        stats["kernel_ops_per_step"] = round(kernel_ops(prof.events()) / calls)
        if traffic:
            with TrafficCounter() as counter:
                fn()
            stats["traffic_mb_per_step"] = round(counter.bytes / 1e6, 1)
    return stats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--presets", default="zinc,pcqm4mv2", help="comma-separated: " + ", ".join(PRESET_DATA))
    parser.add_argument("--attention", default="urpe,rpe", help="comma-separated: urpe, rpe")
    parser.add_argument("--paths", default="eager,compiled",
                        help=f"comma-separated: {', '.join(PATHS)}; NAME@PRECISION runs a path at another "
                             f"Lightning precision ({', '.join(PRECISIONS)}), e.g. compiled@32-true")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps (compilation happens here)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps")
    parser.add_argument("--zinc-batch", type=int, default=None)
    parser.add_argument("--pcqm-batch", type=int, default=None)
    parser.add_argument("--zinc-hops", type=int, default=20,
                        help="max_hops of the ZINC rows (default: the paper's recipe, configs/zinc.yaml)")
    parser.add_argument("--num-workers", type=int, default=None,
                        help="DataLoader processes of the eager path (default: 0 on CPU, 6 on CUDA)")
    parser.add_argument("--compiled-precision", default="bf16-mixed", help="Lightning precision of the compiled path")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: 1 on CPU)")
    parser.add_argument("--shared", type=Path, default=local_data_dir(),
                        help="the local data copies (default: $GRAPHORMER_URPE_DATA or ../shared/data)")
    parser.add_argument("--zinc-root", type=Path, default=Path("data"),
                        help="ZINCDataModule root (ZINC is built there from --shared/zinc when missing)")
    parser.add_argument("--pcqm-root", type=Path, default=None,
                        help="where to write the PCQM4Mv2 fixture (default: a temporary directory)")
    parser.add_argument("--build-workers", type=int, default=None)
    parser.add_argument("--skip-data-only", action="store_true")
    parser.add_argument("--count-ops", type=int, default=0, metavar="P",
                        help="profile P steps after the timed ones and report leaf ATen ops per step")
    parser.add_argument("--top-ops", type=int, default=TOP_OPS, metavar="K",
                        help="with --count-ops: list the K costliest kernels (GPU) or operators (CPU) per row")
    parser.add_argument("--code", default=None, help="a digest of the code measured, recorded with --record")
    parser.add_argument("--record", type=Path, default=None, metavar="FILE",
                        help="also write the results (and --code, and the fastest row) to FILE as JSON")
    parser.add_argument("--width", type=int, default=None,
                        help="hidden and FFN width of the backbone (default: the preset's)")
    args = parser.parse_args(argv)

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but CUDA is not available")
    warmup, steps, zinc_batch, pcqm_batch = DEFAULTS[args.device]
    args.warmup = warmup if args.warmup is None else args.warmup
    args.steps = steps if args.steps is None else args.steps
    args.zinc_batch = args.zinc_batch or zinc_batch
    args.pcqm_batch = args.pcqm_batch or pcqm_batch
    if args.num_workers is None:
        args.num_workers = 6 if args.device == "cuda" else 0
    threads = args.threads or (1 if args.device == "cpu" else None)
    if threads:
        torch.set_num_threads(threads)
    if args.count_ops < 0 or args.top_ops < 1 or (args.width is not None and args.width < 1):
        parser.error("--count-ops must be >= 0, --top-ops and --width >= 1")
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be >= 1")
    presets = [p for p in args.presets.split(",") if p]
    attentions = [a for a in args.attention.split(",") if a]
    paths = [p for p in args.paths.split(",") if p]
    for values, allowed, flag in ((presets, PRESET_DATA, "--presets"), (attentions, ("urpe", "rpe"), "--attention")):
        if not values or set(values) - set(allowed):
            parser.error(f"{flag} takes a comma-separated subset of {list(allowed)}")
    if not paths:
        parser.error("--paths is empty")
    for path in paths:
        try:
            path_spec(path)
        except ValueError as error:
            parser.error(str(error))

    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch.utilities.rank_zero").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")

    temporary = args.pcqm_root is None
    if temporary:
        args.pcqm_root = Path(tempfile.mkdtemp(prefix="bench_train-pcqm-"))
    results: dict = {
        "device": device_name(args.device), "device_kind": args.device, "torch": torch.__version__,
        "date": datetime.date.today().isoformat(), "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "warmup_steps": args.warmup, "steps": args.steps, "training": [], "data_only": [],
    }
    try:
        if any(PRESET_DATA[name][0] == "pcqm4mv2" for name in presets):
            from graphormer_urpe.data.ogb_lsc import PCQM4MV2, RAW_TABLE, write_root

            if not (PCQM4MV2.path(args.pcqm_root) / RAW_TABLE).is_file():
                write_root(args.pcqm_root, args.shared / "pcqm4mv2" / "pcqm4mv2_first2k_3d.csv.gz", PCQM4MV2)
        for name in presets:
            if not args.skip_data_only and name in ("zinc", "pcqm4mv2"):
                results["data_only"] += run_data_only(name, args)
            for path in paths:
                for attention in attentions:
                    row = run_row(name, attention, path, args)
                    results["training"].append(row)
                    outcome = (row["error"] if "error" in row else
                               f"{row['ms_per_step']:10.2f} ms/step (warmup {row['warmup_s']} s)")
                    if "compiled_graphs" in row:
                        outcome += (f" compiled graphs {row['compiled_graphs']}, graph breaks {row['graph_breaks']}, "
                                    f"cudagraph skips {row['cudagraph_skips']}")
                    print(f"  {row['preset']:14s} {attention:5s} {path:12s} {outcome}", flush=True)
                    print_top_ops(row, args.device)
    finally:
        if temporary:
            shutil.rmtree(args.pcqm_root, ignore_errors=True)

    ratios = {}
    timed = [row for row in results["training"] if "error" not in row]
    for row in timed:
        if row["attention"] == "urpe":
            rpe = next((r for r in timed if r["attention"] == "rpe"
                        and (r["preset"], r["path"]) == (row["preset"], row["path"])), None)
            if rpe is not None:
                ratios[f"{row['preset']}/{row['path']}"] = round(row["ms_per_step"] / rpe["ms_per_step"], 3)
    results["urpe_over_rpe_time"] = ratios

    print(f"\n{results['device']} | torch {results['torch']} | {results['date']} | "
          f"{args.warmup} warmup + {args.steps} timed steps")
    header = (f"{'preset':15s} {'attention':9s} {'path':12s} {'impl':6s} {'precision':10s} {'batch':>5s} "
              f"{'ms/step':>9s} {'steps/s':>8s} {'graphs/s':>9s}")
    print(header + ("  peak GiB" if args.device == "cuda" else ""))
    for row in results["training"]:
        if "error" in row:
            print(f"{row['preset']:15s} {row['attention']:9s} {row['path']:12s} failed: {row['error']}")
            continue
        line = (f"{row['preset']:15s} {row['attention']:9s} {row['path']:12s} {row['attention_impl']:6s} "
                f"{row['precision']:10s} {row['batch_size']:5d} {row['ms_per_step']:9.2f} "
                f"{row['steps_per_s']:8.2f} {row['graphs_per_s']:9.1f}")
        print(line + (f"  {row['peak_memory_gib']:8.2f}" if "peak_memory_gib" in row else "")
              + (f"  {row['ops_per_step']} ops/step" if row.get("ops_per_step") is not None else "")
              + (f"  {row['traffic_mb_per_step']:.0f} MB/step" if "traffic_mb_per_step" in row else ""))
    for key, ratio in ratios.items():
        flag = "ok" if ratio <= 1.05 else "above 1.05"
        print(f"URPE / RPE time, {key}: {ratio:.3f} ({flag})")
    if results["data_only"]:
        print(f"\n{'data only (one epoch of training batches on the device)':60s}")
        for row in results["data_only"]:
            print(f"{row['preset']:10s} {row['loader']:28s} batch {row['batch_size']:4d} "
                  f"{row['graphs_per_s']:10.1f} graphs/s")
    if timed:
        fastest = min(timed, key=lambda row: row["ms_per_step"])
        results["fastest"] = {key: fastest[key] for key in ("preset", "attention", "path", "ms_per_step", "steps_per_s")}
        print(f"fastest: {fastest['path']} ({fastest['attention']}), {fastest['ms_per_step']:.2f} ms/step")
    if args.record:
        from graphormer_urpe.utils.files import atomic_write

        with atomic_write(args.record) as handle:
            json.dump({**results, "code": args.code}, handle, indent=1)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

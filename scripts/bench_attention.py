"""The attention core alone: eager vs the fused Triton kernels at several launch configurations.

At the shape a training step gives it (default: the paper's ZINC recipe, Graphormer-slim's 8
heads of width 10 over batches of 256 real ZINC-12k training graphs padded to the split's
largest, N + 1 = 38 tokens, attention dropout 0.1), it times one forward and backward of

* ``eager``: :func:`~graphormer_urpe.nn.attention.eager_attention` as Graphormer calls it (the
  padded keys are ``-inf`` in the bias, no separate mask), float32 core;
* ``fused``: :func:`~graphormer_urpe.nn.fused_attention.fused_urpe_attention` (bias plus padding
  mask) with its default tiles, and with each ``--configs`` entry
  ``fwd=BMxBNwW,dkdv=BMxBNwW,dq=BMxBNwW`` (query tile x key tile, warps; ``s`` = stages, default 2),

with gradients for q, k, v, B and C. Each fused row first checks itself against the eager core on
the first batch without dropout (``max diff``: the largest difference over the output and every
gradient, relative where values exceed 1; full float32 products in both; above 0.05 the
configuration is marked as computing wrongly, not timed). Times (TF32 products, as the engine
trains): the median over ``--batches`` real batches (seeded draws of the training split) of
``--reps`` timed calls each, after ``--warmup`` calls; on a GPU each call is one replay of a CUDA
graph that recorded it (CUDA events). The fused rows need a CUDA device; with ``TRITON_INTERPRET=1``
set before the start, Triton's CPU interpreter checks them without timing them.

Prints a table, then one JSON line (device, versions, date, command, rows).
"""
from __future__ import annotations

import argparse
import datetime
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import device_name  # noqa: E402  (one description of the machine for both benchmarks)
#: Launch configurations timed by default besides the kernels' own: whole key rows per program
#: (L <= 64), smaller tiles with fewer warps (more programs per SM), the whole block, and the
#: float32 tiles from ptxas's register report (the default for heads wider than 16).
DEFAULT_CONFIGS = (
    "fwd=16x64w2,dkdv=16x64w2,dq=16x64w2",
    "fwd=16x64w4,dkdv=16x64w4,dq=16x64w4",
    "fwd=32x32w8,dkdv=16x32w8,dq=32x32w8",
    "fwd=64x64w4,dkdv=64x64w4,dq=64x64w4",
    "fwd=64x64w8,dkdv=64x64w8,dq=64x64w8",
    "fwd=16x32w2,dkdv=16x32w2,dq=16x32w2",
    "fwd=32x32w4,dkdv=16x32w4,dq=32x32w4",
)


def parse_config(text: str, head_dim: int) -> dict[str, dict]:
    """``fwd=16x64w2,dkdv=...,dq=...`` -> the kernels' launch configuration."""
    from graphormer_urpe.nn.fused_attention import head_block

    config = {}
    for part in text.split(","):
        name, _, tile = part.partition("=")
        try:
            shape, _, rest = tile.partition("w")
            warps, _, stages = rest.partition("s")
            block_m, block_n = (int(x) for x in shape.split("x"))
            config[name.strip()] = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=head_block(head_dim),
                                        num_warps=int(warps), num_stages=int(stages or 2))
        except ValueError:
            raise SystemExit(f"--configs: cannot read {part!r} (expected e.g. fwd=16x64w2 or dq=32x32w4s1)") from None
    if sorted(config) != ["dkdv", "dq", "fwd"]:
        raise SystemExit(f"--configs: {text!r} must set fwd, dkdv and dq")
    return config


def zinc_batches(args) -> list[tuple[np.ndarray, int]]:
    """``--batches`` seeded draws of ``--batch`` ZINC-12k training graphs: (node counts, N)."""
    from graphormer_urpe.data import ZINCDataModule
    from graphormer_urpe.data.batch import BatchPadding

    dm = ZINCDataModule(root=str(args.zinc_root), source_dir=str(args.shared / "zinc"))
    dm.prepare_data()
    dataset = dm.train_dataset()
    padding = BatchPadding.covering(dataset.num_nodes, dataset.num_edges, args.batch)
    draws = []
    for seed in range(args.batches):
        index = np.random.default_rng(seed).choice(len(dataset), args.batch, replace=False)
        draws.append((np.asarray(dataset.num_nodes)[index], padding.num_nodes))
    return draws


def attention_inputs(num_nodes: np.ndarray, max_nodes: int, args, device: str, seed: int) -> dict:
    """q, k, v ``[B, H, N+1, d]``, B, C ``[B, H, N+1, N+1]`` (graph token first) and the padding mask."""
    gen = torch.Generator().manual_seed(seed)
    batch, length = len(num_nodes), max_nodes + 1
    shape = (batch, args.heads, length, args.head_dim)
    dtype = getattr(torch, args.dtype)
    q, k, v = (torch.randn(shape, generator=gen).to(device, dtype) for _ in range(3))
    bias = (0.5 * torch.randn(batch, args.heads, length, length, generator=gen)).to(device)
    scale = (1 + 0.1 * torch.randn(batch, args.heads, length, length, generator=gen)).to(device)
    padding = torch.arange(length)[None, :] > torch.as_tensor(num_nodes)[:, None]  # token 0 is real
    return dict(q=q, k=k, v=v, bias=bias, scale=scale, padding=padding.to(device))


def eager_call(inputs: dict, dropout_p: float):
    from graphormer_urpe.nn.attention import eager_attention

    bias = inputs["bias"].masked_fill(inputs["padding"][:, None, None, :], float("-inf"))
    return eager_attention(inputs["q"], inputs["k"], inputs["v"], bias, inputs["scale"], None, dropout_p, False)[0]


def fused_call(config: dict | None):
    from graphormer_urpe.nn.fused_attention import fused_urpe_attention

    def call(inputs: dict, dropout_p: float):
        return fused_urpe_attention(inputs["q"], inputs["k"], inputs["v"], inputs["bias"], inputs["scale"],
                                    inputs["padding"], dropout_p, launch_config=config)
    return call


def forward_backward(call, inputs: dict, dropout_p: float, grad_out: torch.Tensor) -> list[torch.Tensor]:
    leaves = {name: inputs[name].detach().requires_grad_() for name in ("q", "k", "v", "bias", "scale")}
    out = call({**inputs, **leaves}, dropout_p)
    grads = torch.autograd.grad(out, list(leaves.values()), grad_out.to(out.dtype))
    return [out.detach(), *grads]


def max_difference(call, inputs: dict) -> float:
    """Largest difference to the eager core over the output and every gradient, no dropout:
    ``max |a - b|`` of each tensor, divided by its largest ``|b|`` where that is above 1. Both
    with full float32 products (TF32's rounding, ~1e-3, would hide a kernel's own error)."""
    grad_out = torch.randn(inputs["q"].shape, generator=torch.Generator().manual_seed(1)).to(inputs["q"].device)
    timed_precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        got, want = (forward_backward(c, inputs, 0.0, grad_out) for c in (call, eager_call))
    finally:
        torch.set_float32_matmul_precision(timed_precision)
    return max(float(torch.nan_to_num((a.float() - b.float()).abs(), nan=float("inf")).max())
               / max(1.0, float(b.float().abs().max())) for a, b in zip(got, want))


def time_call(call, inputs: dict, args, device: str) -> float:
    """Median ms of one forward and backward over ``--reps`` calls, after ``--warmup``. On a GPU
    the call is recorded in a CUDA graph and replayed, as the training engine runs it: the time
    is the kernels', not the host's launches (which would exceed them at this size)."""
    grad_out = torch.randn(inputs["q"].shape, generator=torch.Generator().manual_seed(2)).to(device)
    run = lambda: forward_backward(call, inputs, args.dropout, grad_out)  # noqa: E731
    if device != "cuda":
        for _ in range(args.warmup):
            run()
        times = []
        for _ in range(args.reps):
            began = time.perf_counter()
            run()
            times.append(1000 * (time.perf_counter() - began))
        return statistics.median(times)
    side = torch.cuda.Stream()  # warmup off the default stream, as a capture needs
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(args.warmup):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    times = []
    for _ in range(args.reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=10)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="q, k, v (B and C stay float32, as under bf16-mixed)")
    parser.add_argument("--configs", nargs="*", default=list(DEFAULT_CONFIGS))
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--zinc-root", type=Path, default=REPO / "data")
    parser.add_argument("--shared", type=Path, default=REPO.parent / "shared" / "data")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: this machine has no CUDA device (torch sees none); use --device cpu")
    torch.set_float32_matmul_precision("high")  # the engine's (TF32 products on a GPU)
    from graphormer_urpe.nn import fused_attention

    kernels_run = args.device == "cuda" or fused_attention.TRITON_INTERPRETED
    rows = [{"name": "eager", "config": None, "call": eager_call}]
    rows.append({"name": "fused default", "config": None, "call": fused_call(None)})
    for text in args.configs:  # read before the data, so a typo costs nothing
        rows.append({"name": text, "config": text, "call": fused_call(parse_config(text, args.head_dim))})
    batches = zinc_batches(args)
    first = attention_inputs(*batches[0], args, args.device, seed=0)
    print(f"attention core, {args.dtype} q/k/v, batch {args.batch}, {args.heads} heads x {args.head_dim}, "
          f"{first['q'].shape[2]} tokens, dropout {args.dropout}; ms per forward + backward, "
          f"median over {args.batches} batches x {args.reps} calls", flush=True)
    for row in rows:
        call = row.pop("call")
        if row["name"] != "eager" and not kernels_run:
            row["skipped"] = "the fused kernels run on CUDA (or under TRITON_INTERPRET=1)"
        else:
            try:
                row["max_diff"] = max_difference(call, first) if row["name"] != "eager" else 0.0
                if row["max_diff"] > 5e-2:
                    row["skipped"] = "differs from the eager core"
                elif row["name"] != "eager" and fused_attention.TRITON_INTERPRETED:
                    row["skipped"] = "checked, not timed: the CPU interpreter's times say nothing"
                else:
                    row["ms"] = statistics.median(
                        time_call(call, attention_inputs(*draw, args, args.device, seed=i), args, args.device)
                        for i, draw in enumerate(batches))
            except Exception as error:  # noqa: BLE001 - a row that fails is reported, the rest go on
                row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
        shown = (f"{row['ms']:9.3f} ms" if "ms" in row else row.get("skipped") or row.get("error"))
        diff = f"  max diff {row['max_diff']:.1e}" if row.get("max_diff") else ""
        print(f"  {row['name']:45s} {shown}{diff}", flush=True)
    eager_ms = rows[0].get("ms")
    timed = [row for row in rows[1:] if "ms" in row]
    best = min(timed, key=lambda row: row["ms"]) if timed else None
    if best is not None and eager_ms and args.device == "cuda":
        print(f"fastest fused: {best['name']} at {best['ms']:.3f} ms, {eager_ms / best['ms']:.2f}x the eager core")
    print(json.dumps({"device": device_name(args.device), "torch": torch.__version__, "date": datetime.date.today().isoformat(),
                      "command": "bench_attention.py " + shlex.join(sys.argv[1:] if argv is None else argv),
                      "dtype": args.dtype, "batch": args.batch, "tokens": int(first["q"].shape[2]),
                      "rows": rows, "fastest_fused": best["name"] if best and args.device == "cuda" else None}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

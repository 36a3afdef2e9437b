"""Several processes against one: the time of a training step of ``graphormer-urpe fit`` with
``--trainer.devices N --trainer.strategy ddp`` (each process at batch ``B``) against one process
at batch ``B``, through the installed command on the real ZINC-12k.

Each run trains ``--warmup`` + ``--steps`` steps of ``configs/zinc.yaml`` (``--width`` wide, 12
layers as the recipe, dropout as the recipe, float32, no validation) on ``--threads`` torch
threads per process; :class:`StepTimer` (passed with ``--trainer.callbacks+``) times the last
``--steps`` on the first process, between the ends of two training batches (the step, the
gradient all-reduce, the stop check of every process and Lightning's loop). Each seed
(``--seeds``) shuffles other batches. On ``N`` processes the step trains ``N`` times the
graphs, so ``ratio`` = its time / one process's time is the cost of the averaging when the
processes have cores of their own: 1.0 is perfect scaling.

Prints a table (processes, batch, seed, median ms/step, ratio), then one JSON line.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl

REPO = Path(__file__).resolve().parents[1]


class StepTimer(pl.Callback):
    """Writes, on the first process, the wall time of each training batch end from step
    ``start`` on to ``output`` (JSON list of seconds between consecutive batch ends)."""

    def __init__(self, start: int, output: str) -> None:
        self.start, self.output, self.ends = start, output, []

    def on_train_batch_end(self, trainer, *args, **kwargs) -> None:
        if trainer.global_step >= self.start:
            self.ends.append(time.perf_counter())

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_rank == 0:
            gaps = [b - a for a, b in zip(self.ends, self.ends[1:])]
            Path(self.output).write_text(json.dumps(gaps))


def run(processes: int, batch: int, seed: int, args, work: Path) -> float:
    """Median seconds per step of one fit."""
    output = work / f"steps-{processes}-{batch}-{seed}.json"
    timer = json.dumps({"class_path": "bench_ddp.StepTimer",
                        "init_args": {"start": args.warmup, "output": str(output)}})
    ddp = ["--trainer.strategy", "ddp"] if processes > 1 else []
    width = {"hidden_dim": args.width, "ffn_dim": args.width}
    command = [str(Path(sys.executable).with_name("graphormer-urpe")), "fit",
               "--config", str(REPO / "configs" / "zinc.yaml"),
               "--trainer.default_root_dir", str(work / f"run-{processes}-{batch}-{seed}"),
               "--trainer.accelerator", "cpu", "--trainer.devices", str(processes), *ddp,
               "--trainer.precision", "32-true", "--trainer.max_steps", str(args.warmup + args.steps + 1),
               "--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar", "false",
               "--trainer.enable_model_summary", "false",
               "--checkpoint.save_last", "false",
               "--model.backbone", json.dumps(width), "--model.total_steps", "1000", "--model.warmup_steps", "10",
               "--data.init_args.root", str(args.zinc_root), "--data.init_args.batch_size", str(batch),
               "--data.init_args.seed", str(seed), "--seed_everything", str(seed),
               "--trainer.callbacks+", timer]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads),
           "PYTHONPATH": os.pathsep.join([str(REPO), str(Path(__file__).parent)])}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"fit failed ({done.returncode}): {done.stderr[-2000:]}")
    return statistics.median(json.loads(output.read_text()))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zinc-root", type=Path, default=REPO / "data",
                        help="a ZINC root (data.init_args.root; built from the local sources when missing)")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32, help="graphs per process and step")
    parser.add_argument("--width", type=int, default=80, help="hidden and FFN width (the recipe's: 80)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for processes in (1, args.processes):  # alternate, so a change of machine load hits both
                seconds = run(processes, args.batch, seed, args, Path(tmp))
                rows.append({"processes": processes, "batch": args.batch, "seed": seed, "ms_per_step": seconds * 1e3})
    by = lambda n: [r["ms_per_step"] for r in rows if r["processes"] == n]  # noqa: E731
    one, many = statistics.median(by(1)), statistics.median(by(args.processes))
    print(f"{'processes':>9} {'batch':>5} {'seed':>4} {'ms/step':>9}")
    for row in rows:
        print(f"{row['processes']:>9} {row['batch']:>5} {row['seed']:>4} {row['ms_per_step']:>9.1f}")
    print(f"median: 1 process {one:.1f} ms, {args.processes} processes {many:.1f} ms, ratio {many / one:.3f}")
    result = {"benchmark": "ddp", "date": datetime.date.today().isoformat(), "machine": platform.processor() or
              platform.machine(), "cpus": os.cpu_count(), "threads_per_process": args.threads,
              "width": args.width, "rows": rows, "one_ms": one, "many_ms": many, "ratio": many / one}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

"""The paper's synthetic sequence tasks, Position Identification (``pi``) and Even Token
Prediction (``etp``), and the resumable grid ``task x vocab x scheme x seed`` of
``graphormer-urpe-synthetic`` (docs/synthetic.md). Each finished cell is kept as
``<run-dir>/<cell>.json`` and ``.pt``; its name ends in a fingerprint of its settings."""
from __future__ import annotations

import csv
import dataclasses
import datetime
import hashlib
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm

from graphormer_urpe.utils.files import atomic_write
from graphormer_urpe.nn.sequence import POSITION_SCHEMES, SequenceTransformer
from graphormer_urpe.training.studies.study import update_block

TASKS: tuple[str, ...] = ("pi", "etp")
TASK_NAMES = {"pi": "Position Identification", "etp": "Even Token Prediction"}
IGNORE_INDEX = -100  # the default of F.cross_entropy
# Held-out batches use a generator seeded far from the training one, so they are fresh sequences.
EVAL_SEED_OFFSET = 1_000_003
RESULTS_BEGIN = "<!-- synthetic-results:begin -->"
RESULTS_END = "<!-- synthetic-results:end -->"


def _check_task(task: str, *schemes: str) -> None:
    if task not in TASKS:
        raise ValueError(f"task={task!r} is not one of {TASKS}")
    for scheme in schemes:
        if scheme not in POSITION_SCHEMES:
            raise ValueError(f"scheme={scheme!r} is not one of {POSITION_SCHEMES}")


def num_classes(task: str, vocab_size: int, length: int) -> int:
    """Output classes per position: ``length`` for ``pi``, ``vocab_size + 1`` (EOS) for ``etp``."""
    _check_task(task)
    return length if task == "pi" else vocab_size + 1


def position_identification_targets(tokens: Tensor) -> Tensor:
    """``[B, L]`` int64 targets ``p`` at position ``p`` (0-based), whatever the tokens."""
    batch, length = tokens.shape
    return torch.arange(length, device=tokens.device).expand(batch, length).clone()


def even_token_targets(tokens: Tensor, eos: int) -> Tensor:
    """``[B, L]`` int64 targets: ``tokens[:, 2p + 1]`` for ``p < L // 2``, ``eos`` at
    ``p = L // 2``, ``IGNORE_INDEX`` after it."""
    batch, length = tokens.shape
    targets = torch.full((batch, length), IGNORE_INDEX, dtype=torch.long, device=tokens.device)
    half = length // 2
    targets[:, :half] = tokens[:, 1::2][:, :half].long()
    if half < length:
        targets[:, half] = eos
    return targets


def make_batch(task: str, batch_size: int, length: int, vocab_size: int,
               generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """A fresh batch ``(tokens [B, L] int32 uniform in [0, vocab_size), targets [B, L] int64)``."""
    _check_task(task)
    if batch_size < 1 or length < 1 or vocab_size < 1:
        raise ValueError(f"batch_size={batch_size}, length={length} and vocab_size={vocab_size} "
                         "must all be positive")
    tokens = torch.randint(vocab_size, (batch_size, length), generator=generator, dtype=torch.int32)
    return tokens, position_identification_targets(tokens) if task == "pi" else even_token_targets(tokens, vocab_size)


@dataclass(frozen=True)
class TrainConfig:
    """Settings of one grid cell (:data:`TASK_OVERRIDES`: each task's departures)."""

    length: int = 128
    embed_dim: int = 64
    num_heads: int = 4
    num_layers: int = 3
    ffn_dim: int = 128
    batch_size: int = 32
    steps: int = 300
    lr: float = 3e-3
    # Adam moves a parameter by about lr a step: the B/C tables get this multiple of it
    table_lr_multiplier: float = 10.0
    warmup_steps: int = 40
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    eval_batches: int = 4
    threads: int = 1

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value, zero_ok = getattr(self, f.name), f.name in ("weight_decay", "warmup_steps")
            if value < 0 or (value == 0 and not zero_ok):
                raise ValueError(f"{f.name}={value} must be {'>= 0' if zero_ok else 'positive'}")

    def fingerprint(self) -> str:
        """Short hash of every setting: cells trained differently get different files."""
        return hashlib.sha1(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:8]


#: Per-task departures from the :class:`TrainConfig` defaults (why: docs/synthetic.md).
TASK_OVERRIDES: dict[str, dict] = {"pi": {}, "etp": {"length": 32, "steps": 1500}}


def task_config(task: str, **overrides) -> TrainConfig:
    """``task``'s settings with ``overrides`` (:class:`TrainConfig` fields; None: the task's)."""
    _check_task(task)
    unknown = set(overrides) - {f.name for f in dataclasses.fields(TrainConfig)}
    if unknown:
        raise ValueError(f"unknown TrainConfig fields {sorted(unknown)}")
    return TrainConfig(**{**TASK_OVERRIDES[task], **{k: v for k, v in overrides.items() if v is not None}})


@dataclass
class CellResult:
    """What one trained cell measured (stored as ``<cell>.json``)."""

    task: str
    vocab_size: int
    scheme: str
    seed: int
    accuracy: float  # token accuracy on held-out batches, over the scored positions
    final_loss: float  # mean training loss over the last 10% of steps
    seconds: float
    config: dict = field(default_factory=dict)
    position_accuracy: list = field(default_factory=list)  # per position, None = not scored


def _scored(model: SequenceTransformer, tokens: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """Logits and targets of the scored positions only (ETP's large head is the costly part)."""
    keep = targets != IGNORE_INDEX
    return model.head(model.encode(tokens)[keep]), targets[keep]


def build_model(task: str, vocab_size: int, scheme: str, config: TrainConfig) -> SequenceTransformer:
    return SequenceTransformer(
        vocab_size=vocab_size, num_classes=num_classes(task, vocab_size, config.length),
        max_len=config.length, position=scheme, embed_dim=config.embed_dim,
        num_heads=config.num_heads, num_layers=config.num_layers, ffn_dim=config.ffn_dim)


def _optimizer(model: SequenceTransformer, config: TrainConfig) -> torch.optim.Optimizer:
    tables = [p for n, p in model.named_parameters() if n.endswith(".table")]
    groups = [{"params": [p for n, p in model.named_parameters() if not n.endswith(".table")]}]
    groups += [{"params": tables, "lr": config.lr * config.table_lr_multiplier, "weight_decay": 0.0}] if tables else []
    return torch.optim.AdamW(groups, lr=config.lr, weight_decay=config.weight_decay)


def _lr_factor(step: int, config: TrainConfig) -> float:
    """Linear warmup, then cosine decay to zero."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


@torch.no_grad()
def evaluate(model: SequenceTransformer, task: str, vocab_size: int, config: TrainConfig,
             seed: int) -> tuple[float, list[float | None]]:
    """Token accuracy over the scored positions of ``eval_batches`` held-out batches, overall
    and per position (None where a position is never scored, e.g. ETP after the EOS)."""
    model.eval()
    generator = torch.Generator().manual_seed(seed + EVAL_SEED_OFFSET)
    correct, total = torch.zeros(config.length), torch.zeros(config.length)
    for _ in range(config.eval_batches):
        tokens, targets = make_batch(task, config.batch_size, config.length, vocab_size, generator)
        logits, scored = _scored(model, tokens, targets)
        keep = targets != IGNORE_INDEX
        hits = torch.zeros(targets.shape)
        hits[keep] = (logits.argmax(-1) == scored).float()
        correct += hits.sum(0)
        total += keep.sum(0)
    model.train()
    per_position = [None if t == 0 else round(float(c / t), 4) for c, t in zip(correct, total)]
    return float(correct.sum() / total.sum()), per_position


def train_cell(task: str, vocab_size: int, scheme: str, seed: int, config: TrainConfig,
               progress: bool = True) -> tuple[CellResult, SequenceTransformer, list[float]]:
    """Train one model from scratch (with ``config.threads`` torch threads, restored after);
    returns its result, the model and the loss per step."""
    _check_task(task, scheme)
    threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        torch.manual_seed(seed)
        model = build_model(task, vocab_size, scheme, config)
        optimizer = _optimizer(model, config)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_factor(step, config))
        generator = torch.Generator().manual_seed(seed)
        losses: list[float] = []
        start = time.perf_counter()
        bar = tqdm(range(config.steps), desc=f"{task} V={vocab_size} {scheme} seed={seed}",
                   disable=not progress, leave=False, file=sys.stderr, mininterval=1.0)
        for step in bar:
            tokens, targets = make_batch(task, config.batch_size, config.length, vocab_size, generator)
            loss = F.cross_entropy(*_scored(model, tokens, targets))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
            if step % 10 == 0:
                bar.set_postfix(loss=f"{losses[-1]:.3f}")
        bar.close()
        accuracy, position_accuracy = evaluate(model, task, vocab_size, config, seed)
    finally:
        torch.set_num_threads(threads)
    tail = losses[-max(1, len(losses) // 10):]
    return CellResult(task, vocab_size, scheme, seed, accuracy, sum(tail) / len(tail), time.perf_counter() - start,
                      asdict(config), position_accuracy), model, losses


def cell_name(task: str, vocab_size: int, scheme: str, seed: int, config: TrainConfig) -> str:
    """``<task>-L<length>-v<vocab>-<scheme>-s<seed>-<fingerprint>``."""
    return f"{task}-L{config.length}-v{vocab_size}-{scheme}-s{seed}-{config.fingerprint()}"


def run_grid(tasks: Sequence[str], vocab_sizes: Sequence[int], schemes: Sequence[str],
             seeds: Sequence[int], config: TrainConfig | Mapping[str, TrainConfig], run_dir: Path,
             progress: bool = True) -> list[CellResult]:
    """Train every missing cell of ``tasks x vocab_sizes x schemes x seeds`` (``config``: one for
    all tasks or one per task); returns all results. A cell's weights (``<name>.pt``) then its
    metrics (``<name>.json``: the cell counts as finished) are saved as soon as it finishes; a
    cell whose JSON exists with the same settings is loaded, not retrained."""
    for task in tasks:
        _check_task(task, *schemes)
    configs = {t: config if isinstance(config, TrainConfig) else config[t] for t in tasks}
    run_dir.mkdir(parents=True, exist_ok=True)
    cells = [(t, v, s, seed) for t in tasks for v in vocab_sizes for s in schemes for seed in seeds]
    results = []
    for index, (task, vocab, scheme, seed) in enumerate(cells, 1):
        config = configs[task]
        name = cell_name(task, vocab, scheme, seed, config)
        stored = json.loads((run_dir / f"{name}.json").read_text()) if (run_dir / f"{name}.json").exists() else {}
        if stored.get("config") == asdict(config):
            result, status = CellResult(**stored), "cached"
        else:
            result, model, losses = train_cell(task, vocab, scheme, seed, config, progress)
            with atomic_write(run_dir / f"{name}.pt", binary=True) as handle:
                torch.save({"state_dict": model.state_dict(), "task": task, "vocab_size": vocab, "scheme": scheme,
                            "seed": seed, "config": asdict(config), "losses": losses, "result": asdict(result)},
                           handle)
            with atomic_write(run_dir / f"{name}.json") as handle:
                handle.write(json.dumps(asdict(result), indent=1))
            status = f"{result.seconds:.0f}s"
        if progress:
            print(f"[{index}/{len(cells)}] {name}: accuracy {result.accuracy:.4f} ({status})",
                  file=sys.stderr, flush=True)
        results.append(result)
    return results


def summarize(results: Iterable[CellResult]) -> list[dict]:
    """One row per (task, length, vocab, scheme): accuracy per seed and their mean."""
    rows: dict[tuple, dict] = {}
    for r in results:
        length = r.config["length"]
        row = rows.setdefault((r.task, length, r.vocab_size, r.scheme), {
            "task": r.task, "length": length, "vocab_size": r.vocab_size, "scheme": r.scheme,
            "steps": r.config["steps"], "seeds": [], "accuracies": []})
        row["seeds"].append(r.seed)
        row["accuracies"].append(r.accuracy)
    for row in rows.values():
        row["mean"] = statistics.fmean(row["accuracies"])
    return list(rows.values())


def markdown_table(rows: Sequence[dict]) -> str:
    """Token accuracy (%) per task, vocabulary and scheme, with each seed and the mean."""
    lines = ["| task | length | vocab | scheme | steps | accuracy per seed (%) | mean (%) |",
             "|---|---:|---:|---|---:|---|---:|"]
    for row in rows:
        per_seed = ", ".join(f"s{s}: {100 * a:.1f}" for s, a in zip(row["seeds"], row["accuracies"]))
        lines.append(f"| {TASK_NAMES[row['task']]} | {row['length']} | {row['vocab_size']:,} | "
                     f"{row['scheme']} | {row['steps']} | {per_seed} | **{100 * row['mean']:.1f}** |")
    return "\n".join(lines)


def write_reports(results: Sequence[CellResult], results_dir: Path | None,
                  markdown: Path | None, command: str) -> str:
    """Write ``synthetic.json``/``.csv`` to ``results_dir`` and the table into ``markdown``
    (between :data:`RESULTS_BEGIN` and :data:`RESULTS_END`; appended when the markers are
    missing). Returns the table."""
    rows = summarize(results)
    table = markdown_table(rows)
    if results_dir is not None:
        results_dir.mkdir(parents=True, exist_ok=True)
        with atomic_write(results_dir / "synthetic.json") as handle:
            handle.write(json.dumps({"command": command, "cells": [asdict(r) for r in results], "summary": rows},
                                    indent=1))
        with atomic_write(results_dir / "synthetic.csv") as handle:
            writer = csv.writer(handle)
            writer.writerow(["task", "length", "vocab_size", "scheme", "seed", "steps", "accuracy", "final_loss",
                             "seconds"])
            writer.writerows([r.task, r.config["length"], r.vocab_size, r.scheme, r.seed, r.config["steps"],
                              f"{r.accuracy:.6f}", f"{r.final_loss:.6f}", f"{r.seconds:.1f}"] for r in results)
    if markdown is not None:
        threads = "/".join(map(str, sorted({r.config.get("threads") for r in results}, key=str)))
        machine = (f"{os.cpu_count()}-core {platform.machine()} CPU, torch {torch.__version__}, "
                   f"{threads} thread(s) per run")
        markdown.parent.mkdir(parents=True, exist_ok=True)
        update_block(markdown, RESULTS_BEGIN, RESULTS_END, lambda: f"Command: `{command}`; machine: {machine}; "
                     f"written {datetime.date.today().isoformat()}.\n\n{table}", new="# Synthetic tasks\n")
    return table

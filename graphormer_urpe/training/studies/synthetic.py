r"""The paper's synthetic sequence tasks (Luo et al., 2022, Figure 1) and a resumable grid runner.

Tasks (sequences of ``n`` tokens drawn uniformly from a vocabulary of size ``V``, generated on
the fly from a seeded ``torch.Generator``; positions below are 0-based, ``p = 0 .. n-1``):

* ``pi`` - Position Identification, :math:`f(w_1..w_n) = (1, .., n)`: position ``p`` must
  output the class ``p`` (``n`` classes).
* ``etp`` - Even Token Prediction, :math:`f(w_1..w_n) = (w_2, w_4, .., \mathrm{EOS})`. With an
  encoder-only model every position emits one output: position ``p`` predicts the token at
  index ``2p + 1`` (that is :math:`w_{2(p+1)}`) while ``2p + 1 < n``; the next position,
  ``p = n // 2``, predicts ``EOS`` (class ``V``); later positions are ignored by the loss
  and the accuracy (target ``IGNORE_INDEX``). For ``n = 128`` that is 64 tokens + EOS.

Both tasks are trivial with absolute positions and impossible without any position
information; the paper's point is that RPE (softmax rows sum to one, so a Toeplitz bias cannot
tell positions apart) fails them while URPE (a learnable Toeplitz scale after the softmax)
solves them.

The grid (``task x vocab x scheme x seed``, :func:`run_grid`; the command
``graphormer-urpe-synthetic``) writes each finished cell to ``<run-dir>/<cell>.json`` (metrics)
and ``<run-dir>/<cell>.pt`` (weights, for ``graphormer-urpe-plot``) before the next starts, so a
killed grid resumes where it stopped. The cell name ends in a fingerprint of its settings
(:meth:`TrainConfig.fingerprint`): changed settings train new cells beside the old.
:func:`write_reports` writes the table into a markdown file (between the ``results`` markers)
and ``synthetic.{json,csv}``.
"""
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

TASKS: tuple[str, ...] = ("pi", "etp")
TASK_NAMES = {"pi": "Position Identification", "etp": "Even Token Prediction"}
IGNORE_INDEX = -100  # the default of F.cross_entropy
# Held-out batches use a generator seeded far from the training one, so they are fresh sequences.
EVAL_SEED_OFFSET = 1_000_003
RESULTS_BEGIN = "<!-- synthetic-results:begin -->"
RESULTS_END = "<!-- synthetic-results:end -->"


# --------------------------------------------------------------------------------------------
# Tasks
# --------------------------------------------------------------------------------------------
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


def sample_tokens(batch_size: int, length: int, vocab_size: int,
                  generator: torch.Generator) -> Tensor:
    """Uniform random token ids ``[B, L]`` int32 in ``[0, vocab_size)``."""
    if batch_size < 1 or length < 1 or vocab_size < 1:
        raise ValueError(f"batch_size={batch_size}, length={length} and vocab_size={vocab_size} "
                         "must all be positive")
    return torch.randint(vocab_size, (batch_size, length), generator=generator, dtype=torch.int32)


def position_identification_targets(tokens: Tensor) -> Tensor:
    """``[B, L]`` int64 targets ``p`` at position ``p`` (0-based), whatever the tokens."""
    batch, length = tokens.shape
    return torch.arange(length, device=tokens.device).expand(batch, length).clone()


def even_token_targets(tokens: Tensor, eos: int) -> Tensor:
    """``[B, L]`` int64 targets: ``tokens[:, 2p + 1]`` for ``p < L // 2``, ``eos`` at
    ``p = L // 2`` (when ``L`` is odd or even alike), ``IGNORE_INDEX`` after it."""
    batch, length = tokens.shape
    targets = torch.full((batch, length), IGNORE_INDEX, dtype=torch.long, device=tokens.device)
    half = length // 2
    targets[:, :half] = tokens[:, 1::2][:, :half].long()
    if half < length:
        targets[:, half] = eos
    return targets


def make_batch(task: str, batch_size: int, length: int, vocab_size: int,
               generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """A fresh batch ``(tokens [B, L] int32, targets [B, L] int64)`` of ``task``."""
    _check_task(task)
    tokens = sample_tokens(batch_size, length, vocab_size, generator)
    if task == "pi":
        return tokens, position_identification_targets(tokens)
    return tokens, even_token_targets(tokens, eos=vocab_size)


# --------------------------------------------------------------------------------------------
# Training one cell
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TrainConfig:
    """Settings of one training run (one grid cell).

    The paper's setting is 3 layers and length 128; width, batch and steps are sized for a
    2-core CPU box. :data:`TASK_OVERRIDES` holds the per-task departures from these defaults.
    """

    length: int = 128
    embed_dim: int = 64
    num_heads: int = 4
    num_layers: int = 3
    ffn_dim: int = 128
    batch_size: int = 32
    steps: int = 300
    lr: float = 3e-3
    # Adam moves every parameter by about ``lr`` per step whatever its gradient, so in a short
    # run a B/C table entry can travel at most ``lr * steps`` from its init; the tables (a few
    # hundred numbers per layer, RPE's and URPE's alike) get this multiple of ``lr``.
    table_lr_multiplier: float = 10.0
    warmup_steps: int = 40
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    eval_batches: int = 4
    threads: int = 1

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("weight_decay", "warmup_steps"):
                if value < 0:
                    raise ValueError(f"{f.name}={value} must be >= 0")
            elif value <= 0:
                raise ValueError(f"{f.name}={value} must be positive")

    def fingerprint(self) -> str:
        """Short hash of every setting: cells trained differently get different files."""
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha1(text.encode()).hexdigest()[:8]


#: Per-task departures from the :class:`TrainConfig` defaults. ETP must learn to copy one of
#: ``V`` tokens through attention; at length 128 even APE stays on the loss plateau
#: ``ln(V + 1)`` for 800 steps, at length 32 it leaves it within a few hundred (measurements in
#: docs/synthetic.md), so the default grid runs ETP at length 32, for longer.
TASK_OVERRIDES: dict[str, dict] = {"pi": {}, "etp": {"length": 32, "steps": 1500}}


def task_config(task: str, **overrides) -> TrainConfig:
    """The default settings of ``task`` with ``overrides`` (fields of :class:`TrainConfig`;
    None values are ignored) applied on top."""
    _check_task(task)
    unknown = set(overrides) - {f.name for f in dataclasses.fields(TrainConfig)}
    if unknown:
        raise ValueError(f"unknown TrainConfig fields {sorted(unknown)}")
    given = {k: v for k, v in overrides.items() if v is not None}
    return TrainConfig(**{**TASK_OVERRIDES[task], **given})


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
    """Logits and targets of the scored positions only (ETP ignores half the positions, and
    its 10,001-way head is the costliest part of a step)."""
    keep = targets != IGNORE_INDEX
    hidden = model.encode(tokens)
    return model.head(hidden[keep]), targets[keep]


def build_model(task: str, vocab_size: int, scheme: str, config: TrainConfig) -> SequenceTransformer:
    return SequenceTransformer(
        vocab_size=vocab_size, num_classes=num_classes(task, vocab_size, config.length),
        max_len=config.length, position=scheme, embed_dim=config.embed_dim,
        num_heads=config.num_heads, num_layers=config.num_layers, ffn_dim=config.ffn_dim)


def _optimizer(model: SequenceTransformer, config: TrainConfig) -> torch.optim.Optimizer:
    tables = [p for n, p in model.named_parameters() if n.endswith(".table")]
    table_ids = {id(p) for p in tables}
    others = [p for p in model.parameters() if id(p) not in table_ids]
    groups = [{"params": others}]
    if tables:
        groups.append({"params": tables, "lr": config.lr * config.table_lr_multiplier,
                       "weight_decay": 0.0})
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
    correct = torch.zeros(config.length)
    total = torch.zeros(config.length)
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
        return _train(task, vocab_size, scheme, seed, config, progress)
    finally:
        torch.set_num_threads(threads)


def _train(task: str, vocab_size: int, scheme: str, seed: int, config: TrainConfig,
           progress: bool) -> tuple[CellResult, SequenceTransformer, list[float]]:
    torch.manual_seed(seed)
    model = build_model(task, vocab_size, scheme, config)
    optimizer = _optimizer(model, config)
    base_lrs = [group["lr"] for group in optimizer.param_groups]
    generator = torch.Generator().manual_seed(seed)
    losses: list[float] = []
    start = time.perf_counter()
    bar = tqdm(range(config.steps), desc=f"{task} V={vocab_size} {scheme} seed={seed}",
               disable=not progress, leave=False, file=sys.stderr, mininterval=1.0)
    for step in bar:
        for group, base in zip(optimizer.param_groups, base_lrs):
            group["lr"] = base * _lr_factor(step, config)
        tokens, targets = make_batch(task, config.batch_size, config.length, vocab_size, generator)
        logits, scored = _scored(model, tokens, targets)
        loss = F.cross_entropy(logits, scored)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        losses.append(loss.item())
        if step % 10 == 0:
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    bar.close()
    accuracy, position_accuracy = evaluate(model, task, vocab_size, config, seed)
    tail = losses[-max(1, len(losses) // 10):]
    result = CellResult(task=task, vocab_size=vocab_size, scheme=scheme, seed=seed,
                        accuracy=accuracy, final_loss=sum(tail) / len(tail),
                        seconds=time.perf_counter() - start, config=asdict(config),
                        position_accuracy=position_accuracy)
    return result, model, losses


# --------------------------------------------------------------------------------------------
# The grid
# --------------------------------------------------------------------------------------------
def cell_name(task: str, vocab_size: int, scheme: str, seed: int, config: TrainConfig) -> str:
    """``<task>-L<length>-v<vocab>-<scheme>-s<seed>-<fingerprint>``."""
    return f"{task}-L{config.length}-v{vocab_size}-{scheme}-s{seed}-{config.fingerprint()}"


def load_cell(run_dir: Path, name: str, config: TrainConfig) -> CellResult | None:
    """The stored result of a cell, or None when it is missing or was trained differently."""
    path = run_dir / f"{name}.json"
    if not path.exists():
        return None
    stored = json.loads(path.read_text())
    if stored.get("config") != asdict(config):
        return None
    return CellResult(**stored)


def run_grid(tasks: Sequence[str], vocab_sizes: Sequence[int], schemes: Sequence[str],
             seeds: Sequence[int], config: TrainConfig | Mapping[str, TrainConfig], run_dir: Path,
             progress: bool = True) -> list[CellResult]:
    """Train every missing cell of ``tasks x vocab_sizes x schemes x seeds``; returns all results.

    ``config`` is one :class:`TrainConfig` for all tasks or one per task. Each cell's metrics
    (``<name>.json``) and weights (``<name>.pt``: ``state_dict``, the cell's settings and the
    result) are saved as soon as it finishes; a cell whose JSON exists is loaded, not retrained.
    The name carries a fingerprint of the settings, so changed settings train new cells.
    """
    for task in tasks:
        _check_task(task, *schemes)
    configs = {t: config if isinstance(config, TrainConfig) else config[t] for t in tasks}
    run_dir.mkdir(parents=True, exist_ok=True)
    cells = [(t, v, s, seed) for t in tasks for v in vocab_sizes for s in schemes for seed in seeds]
    results = []
    for index, (task, vocab, scheme, seed) in enumerate(cells, 1):
        config = configs[task]
        name = cell_name(task, vocab, scheme, seed, config)
        result = load_cell(run_dir, name, config)
        if result is not None:
            status = "cached"
        else:
            result, model, losses = train_cell(task, vocab, scheme, seed, config, progress)
            checkpoint = {"state_dict": model.state_dict(), "task": task, "vocab_size": vocab,
                          "scheme": scheme, "seed": seed, "config": asdict(config),
                          "losses": losses, "result": asdict(result)}
            # Weights first: a cell counts as finished only once its JSON exists.
            with atomic_write(run_dir / f"{name}.pt", binary=True) as handle:
                torch.save(checkpoint, handle)
            with atomic_write(run_dir / f"{name}.json") as handle:
                handle.write(json.dumps(asdict(result), indent=1))
            status = f"{result.seconds:.0f}s"
        if progress:
            print(f"[{index}/{len(cells)}] {name}: accuracy {result.accuracy:.4f} ({status})",
                  file=sys.stderr, flush=True)
        results.append(result)
    return results


def summarize(results: Iterable[CellResult]) -> list[dict]:
    """One row per (task, vocab, scheme): accuracy per seed and their mean."""
    rows: dict[tuple, dict] = {}
    for r in results:
        length = r.config["length"]
        row = rows.setdefault((r.task, length, r.vocab_size, r.scheme),
                              {"task": r.task, "length": length, "vocab_size": r.vocab_size,
                               "scheme": r.scheme, "steps": r.config["steps"], "seeds": [],
                               "accuracies": []})
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


def _machine(results: Sequence[CellResult]) -> str:
    threads = sorted({r.config.get("threads") for r in results}, key=str)
    return (f"{os.cpu_count()}-core {platform.machine()} CPU, torch {torch.__version__}, "
            f"{'/'.join(map(str, threads))} thread(s) per run")


def write_reports(results: Sequence[CellResult], results_dir: Path | None,
                  markdown: Path | None, command: str) -> str:
    """Write ``synthetic.json``/``.csv`` to ``results_dir`` and the table into ``markdown``
    (between :data:`RESULTS_BEGIN` and :data:`RESULTS_END`; appended when the markers are
    missing). Returns the table."""
    rows = summarize(results)
    table = markdown_table(rows)
    if results_dir is not None:
        results_dir.mkdir(parents=True, exist_ok=True)
        payload = {"command": command, "cells": [asdict(r) for r in results], "summary": rows}
        with atomic_write(results_dir / "synthetic.json") as handle:
            handle.write(json.dumps(payload, indent=1))
        with atomic_write(results_dir / "synthetic.csv") as fh:
            writer = csv.writer(fh)
            writer.writerow(["task", "length", "vocab_size", "scheme", "seed", "steps",
                             "accuracy", "final_loss", "seconds"])
            for r in results:
                writer.writerow([r.task, r.config["length"], r.vocab_size, r.scheme, r.seed,
                                 r.config["steps"], f"{r.accuracy:.6f}", f"{r.final_loss:.6f}",
                                 f"{r.seconds:.1f}"])
    if markdown is not None:
        block = (f"{RESULTS_BEGIN}\nCommand: `{command}`; machine: {_machine(results)}; "
                 f"written {datetime.date.today().isoformat()}.\n\n{table}\n{RESULTS_END}")
        text = markdown.read_text() if markdown.exists() else "# Synthetic tasks\n"
        if RESULTS_BEGIN in text and RESULTS_END in text:
            head, rest = text.split(RESULTS_BEGIN, 1)
            text = head + block + rest.split(RESULTS_END, 1)[1]
        else:
            text = text.rstrip("\n") + "\n\n" + block + "\n"
        markdown.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(markdown) as handle:
            handle.write(text)
    return table

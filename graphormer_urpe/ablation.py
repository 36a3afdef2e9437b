"""``graphormer-urpe-ablation``: the seeded URPE-vs-RPE ablation on one recipe, resumable.

A grid of arms (``urpe``: B and C; ``rpe``: plain Graphormer, B only; ``urpe-shared``: one C for
all layers) x seeds is trained with the training CLI (``graphormer-urpe fit``), one subprocess
per run, on the same recipe (config files plus LightningCLI overrides). Every run:

* lives in ``<runs-dir>/<name>/<arm>-s<seed>/`` with its logs, checkpoints and ``ablation_run.json``
  (its arguments, commit, attempts and result);
* takes ``seed`` both as ``seed_everything`` (initialisation, dropout) and as the training-order
  seed of the DataModule;
* resumes from its ``checkpoints/last.ckpt`` when the grid was killed (its steps are the
  checkpoint's ``global_step``), starts over when it has none, and is not redone once it has a
  result;
* is trained by one runner at a time: the runner holds ``ablation.lock`` in every run directory of
  its grid, and a second runner given any of them stops at once (exit status 2) naming the first
  one's pid;
* is selected on the validation metric of its task only (the CLI's best checkpoint: ``val/mae``
  for regression, see :mod:`graphormer_urpe.task`) and that checkpoint is evaluated on
  the test split (``graphormer-urpe test``).

Results are merged into a JSON list (default ``docs/results/zinc_ablation.json``; one entry per
``(recipe, attention, seed)``, a rerun replaces its entry) and summarised in a markdown table: mean
+- sample std per arm and the per-seed paired difference ``arm - rpe``.

``--time-budget`` (e.g. ``9m``) trains in time slices instead of each run to its end: the runs of
the first seed with unfinished runs advance one slice at a time (``--slice``, by default the
budget shared by that seed's arms), the run with the fewest steps first, so the arms of a seed
stay within one slice of each other; the next seed starts when the previous one is done. A slice
ends with SIGTERM to its ``fit``, which saves the run's whole state (weights, AdamW, schedule,
RNG, data position) in ``last.ckpt`` at the end of the step in progress; the same command, here
or on another machine, continues exactly where it stopped. A finished run is tested at once.

    graphormer-urpe-ablation --config configs/zinc.yaml --name zinc-400k \\
        --seeds 0 1 2 --figures docs/figures   # the paper's 400k steps, each run to its end
    graphormer-urpe-ablation --config configs/zinc.yaml --name zinc-paper --time-budget 8m \\
        --runs-dir results/runs --results docs/results/zinc_gpu.json --readme README.md
        # 8 minutes further, then the progress table in README.md
    graphormer-urpe-ablation --config configs/zinc.yaml --config configs/zinc_v2.yaml \\
        --name cpu-slim-1256 --jobs 2 --threads-per-job 1 --trainer.precision 32-true --trainer.max_steps 1256 \\
        --model.warmup_steps 126 --model.total_steps 1256   # a CPU budget: 8 epochs
    graphormer-urpe-ablation --table-only     # rewrite the table from the JSON

``--readme FILE`` writes the recipe's result table into FILE between ``<!-- ablation:NAME -->``
and ``<!-- /ablation:NAME -->``, and its progress table (steps done, best and latest validation
metric, device time, steps/s, device per run) between ``<!-- ablation-progress:NAME -->`` and
``<!-- /ablation-progress:NAME -->``, after every invocation, also one stopped by a signal.

Several GPUs: one invocation per GPU (``CUDA_VISIBLE_DEVICES=i``, its own ``--seeds``) with the
same ``--name`` and ``--results``; the results file is merged under a lock (build the data first, e.g. with one finished run).

Arguments this runner does not know are passed to every ``fit`` and ``test`` unchanged.
Run it again with the same arguments to continue a killed grid.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

from graphormer_urpe.ablation_results import (
    DEFAULT_RESULTS, code_commit, describe_device, merge_results, metric_of, now, read_results,
    readme_block, write_progress_block, write_readme_block, write_table)
from graphormer_urpe.files import check_creatable_dir, check_writable_dir, hold_directory, read_json, write_json

#: What each arm changes in the recipe's ``model.backbone`` (merged into it; everything else in
#: the backbone, e.g. a smaller model, stays as the recipe has it).
ARMS: dict[str, dict[str, Any]] = {
    "urpe": {"attention": "urpe", "share_urpe_scale": False},
    "rpe": {"attention": "rpe"},
    "urpe-shared": {"attention": "urpe", "share_urpe_scale": True},
}
RUN_RECORD = "ablation_run.json"
#: In a run directory: held (``fcntl.flock``) by the runner that trains it, and names its pid.
LOCK_FILE = "ablation.lock"
#: Seconds between updates of a running attempt's wall time in its run record.
HEARTBEAT_S = 15.0
#: A slice shorter than this is not started (a ``fit`` needs seconds to start before it trains).
MIN_SLICE_S = 20.0
#: Seconds a ``fit`` has to save and stop after its SIGTERM (the step in progress, a validation,
#: the checkpoint) before it is killed.
STOP_GRACE_S = 180.0
#: Exit statuses of a ``fit`` stopped by the SIGTERM that ends its slice (the CLI's 128 + 15, or
#: the signal itself when it came before the CLI handles it).
SLICE_END_STATUSES = (128 + signal.SIGTERM, -signal.SIGTERM)
#: The seeds ``seed_everything`` takes (numpy's).
MAX_SEED = 2**32 - 1


# --------------------------------------------------------------------------------------------
# One run: fit (resumed from last.ckpt), then test the best validation checkpoint
# --------------------------------------------------------------------------------------------
def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Linux: the training subprocess gets SIGKILL when the runner dies, so a killed grid
    leaves no orphan writing into a run directory that the next invocation resumes."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM to a still running child (it saves its state at the end of its step), then wait
    :data:`STOP_GRACE_S` for it, else SIGKILL."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def checkpoint_step(path: Path) -> int:
    """The optimizer steps a checkpoint holds (its ``global_step``)."""
    from graphormer_urpe.checkpoint import read_checkpoint

    return int(read_checkpoint(path)["global_step"])


def read_metric(metrics_csv: Path, name: str) -> float:
    with open(metrics_csv, newline="") as handle:
        values = [row[name] for row in csv.DictReader(handle) if row.get(name)]
    if not values:
        raise RuntimeError(f"{metrics_csv}: no {name} logged")
    return float(values[-1])


def latest_logged(run_dir: Path, name: str) -> float | None:
    """The value of ``name`` at the highest step in the run's CSV logs (one ``csv/version_*``
    folder per fit or resume), or None when none logged it."""
    latest: tuple[int, float] | None = None
    for metrics in run_dir.glob("csv/*/metrics.csv"):
        with open(metrics, newline="") as handle:
            for row in csv.DictReader(handle):
                if row.get(name) and (latest is None or int(row["step"]) >= latest[0]):
                    latest = (int(row["step"]), float(row[name]))
    return None if latest is None else latest[1]


def best_score(last: Path) -> tuple[str, float | None]:
    """``(metric, best validation score)`` that a ``last.ckpt`` records (its checkpoint
    callback's ``best_model_score``; None before the first validation)."""
    from graphormer_urpe.checkpoint import read_checkpoint
    from graphormer_urpe.data.facts import DataFacts
    from graphormer_urpe.task import get_task

    checkpoint = read_checkpoint(last)
    task = get_task(DataFacts.recorded(checkpoint.get("hyper_parameters", {}), "task"))
    scores = [state.get("best_model_score") for key, state in checkpoint.get("callbacks", {}).items()
              if key.startswith("ModelCheckpoint") and state.get("monitor") == task.monitor]
    score = scores[0] if scores else None
    return task.metric_name, None if score is None else float(score)


def parse_duration(text: str) -> float:
    """Seconds in ``90``, ``90s``, ``9m``, ``1h30m``; ValueError for anything else or 0."""
    match = re.fullmatch(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s?)?", text.strip())
    if not text.strip() or match is None:
        raise ValueError(f"expected a duration such as 540, 540s, 9m or 1h30m, got {text!r}")
    hours, minutes, seconds = (float(g) if g else 0.0 for g in match.groups())
    total = 3600 * hours + 60 * minutes + seconds
    if total <= 0:
        raise ValueError(f"expected a positive duration, got {text!r}")
    return total


class Run:
    """One ``(arm, seed)`` of the grid and its run directory."""

    def __init__(self, grid: "Grid", arm: str, seed: int) -> None:
        self.grid, self.arm, self.seed = grid, arm, seed
        self.dir = grid.dir / f"{arm}-s{seed}"
        self.record_path = self.dir / RUN_RECORD
        self.last = self.dir / "checkpoints" / "last.ckpt"

    @property
    def cli_args(self) -> list[str]:
        """The recipe, the arm's backbone (after the recipe: LightningCLI replaces a dict
        argument rather than merging it) and the seed."""
        backbone = {**self.grid.recipe_backbone, **ARMS[self.arm]}
        return [*self.grid.recipe_args, "--model.backbone", json.dumps(backbone),
                "--seed_everything", str(self.seed), "--data.init_args.seed", str(self.seed),
                "--trainer.default_root_dir", str(self.dir)]

    @property
    def label(self) -> str:
        return f"{self.grid.name}/{self.arm}-s{self.seed}"

    def load_record(self) -> dict:
        record = read_json(self.record_path, None)
        if record is None:
            return {"cli_args": self.cli_args, "commit": self.grid.commit, "attempts": []}
        from graphormer_urpe.training.cli import training_args

        if training_args(record["cli_args"]) != training_args(self.cli_args):
            raise ValueError(f"{self.dir} was started with other arguments ({' '.join(record['cli_args'])}; "
                             f"now {' '.join(self.cli_args)}): choose another --name or remove it")
        return record

    def steps(self) -> int:
        """The optimizer steps its ``last.ckpt`` holds (0 without one)."""
        return checkpoint_step(self.last) if self.last.exists() else 0

    def fits(self) -> int:
        """The ``fit`` attempts its record holds."""
        return sum(a["stage"] == "fit" for a in read_json(self.record_path, {"attempts": []})["attempts"])

    def _subprocess(self, stage: str, args: list[str], record: dict, seconds: float | None = None) -> dict:
        """``graphormer-urpe <stage> args`` with its output appended to ``<stage>.log``; the
        attempt's wall time is kept up to date in the run record (a kill loses < HEARTBEAT_S).
        With ``seconds``, the command gets SIGTERM after that long (the end of a slice: a fit
        saves its state and stops). The attempt (its record entry)."""
        command = [sys.executable, "-m", "graphormer_urpe.training.cli", stage, *args]
        attempt = {"stage": stage, "started": now(), "commit": self.grid.commit, "device": self.grid.device,
                   "wall_s": 0.0, "returncode": None}
        record["attempts"].append(attempt)
        write_json(self.record_path, record)
        start = time.perf_counter()
        deadline = None if seconds is None else start + seconds
        with open(self.dir / f"{stage}.log", "a") as log:
            log.write(f"\n# {now()} {' '.join(command)}\n")
            log.flush()
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                       env=self.grid.child_env, preexec_fn=_die_with_parent)
            try:
                returncode = self._wait(process, attempt, record, start, deadline)
            except BaseException:  # the runner stopped (Ctrl-C, SIGTERM): the fit saves and stops first
                _stop(process)
                attempt.update(wall_s=round(time.perf_counter() - start, 1), returncode=process.returncode)
                write_json(self.record_path, record)
                raise
        attempt.update(wall_s=round(time.perf_counter() - start, 1), returncode=returncode)
        write_json(self.record_path, record)
        if returncode != 0 and not ("slice_end" in attempt and returncode in SLICE_END_STATUSES):
            raise RuntimeError(f"{self.label}: {stage} failed (exit {returncode}); see "
                               f"{self.dir / (stage + '.log')}")
        return attempt

    def _wait(self, process: subprocess.Popen, attempt: dict, record: dict, start: float,
              deadline: float | None) -> int:
        """Wait for ``process``, updating the attempt's wall time every :data:`HEARTBEAT_S`; at
        ``deadline``, SIGTERM (the slice's end), and SIGKILL :data:`STOP_GRACE_S` later."""
        while True:
            now_s = time.perf_counter()
            wait = HEARTBEAT_S
            if deadline is not None:
                end = deadline if "slice_end" not in attempt else deadline + STOP_GRACE_S
                wait = min(wait, max(end - now_s, 0.0))
            try:
                return process.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                now_s = time.perf_counter()
                if deadline is not None and "slice_end" not in attempt and now_s >= deadline:
                    process.send_signal(signal.SIGTERM)
                    attempt["slice_end"] = now()
                elif deadline is not None and now_s >= deadline + STOP_GRACE_S:
                    process.kill()
                    attempt["killed"] = now()
                attempt["wall_s"] = round(now_s - start, 1)
                write_json(self.record_path, record)

    def fit(self, record: dict, seconds: float | None = None) -> bool:
        """Fit from ``last.ckpt`` (or from the start), to the end of the recipe's steps or for
        ``seconds``; whether the fit is done."""
        before = self.steps()
        if self.last.exists():
            resume = ["--ckpt_path", str(self.last)]
            self.grid.log(f"{self.label}: fit (resuming from last.ckpt at step {before})"
                          + (f" for {seconds:.0f} s" if seconds else ""))
        else:  # no resumable state: checkpoints of a run killed before its first last.ckpt go
            resume = ["--checkpoint.overwrite", "true"]
            self.grid.log(f"{self.label}: fit" + (f" for {seconds:.0f} s" if seconds else ""))
        attempt = self._subprocess("fit", [*self.cli_args, *resume], record, seconds)
        attempt["steps"] = [before, self.steps()]
        record["fit_done"] = attempt["returncode"] == 0 or 0 < self.grid.max_steps <= attempt["steps"][1]
        write_json(self.record_path, record)
        return record["fit_done"]

    def execute(self, seconds: float | None = None) -> dict | None:
        """Fit (or resume), test, and return the result entry; a finished run returns its
        stored result without running anything. With ``seconds``, one slice of the fit: None
        when the fit is not done by then."""
        self.dir.mkdir(parents=True, exist_ok=True)
        record = self.load_record()
        if "result" in record:
            return record["result"]
        if not record.get("fit_done") and not self.fit(record, seconds):
            return None
        from graphormer_urpe.prediction.load import best_checkpoint

        best, val_score, best_step, steps, task = best_checkpoint(self.dir)
        test_logger = json.dumps({"class_path": "lightning.pytorch.loggers.CSVLogger",
                                  "init_args": {"save_dir": str(self.dir), "name": "test",
                                                "version": best.stem}})
        self.grid.log(f"{self.label}: test {best.name}")
        self._subprocess("test", [*self.cli_args, "--trainer.logger", test_logger,
                                  "--ckpt_path", str(best)], record)
        test_score = read_metric(self.dir / "test" / best.stem / "metrics.csv", f"test/{task.metric_name}")
        commits = sorted({a["commit"] for a in record["attempts"]})
        devices = sorted({a["device"] for a in record["attempts"] if a.get("device")}) or [self.grid.device]
        record["result"] = {
            "recipe": self.grid.name, "attention": self.arm, "seed": self.seed, "steps": steps,
            "best_step": best_step, "task": task.name, f"val_{task.metric_name}": round(val_score, 6),
            f"test_{task.metric_name}": round(test_score, 6),
            "wall_s": round(sum(a["wall_s"] for a in record["attempts"]), 1),
            "device": devices[0] if len(devices) == 1 else "; ".join(devices),
            "commit": commits[0] if len(commits) == 1 else commits,
            "budget": self.grid.budget, "finished": now(),
        }
        write_json(self.record_path, record)
        return record["result"]

    def progress(self) -> dict:
        """Where the run stands, for the progress table: steps done, best and latest validation
        metric, device time (every attempt's wall time), steps per second of that time, devices."""
        record = read_json(self.record_path, {"attempts": []})
        entry = {"run": f"{self.arm}-s{self.seed}", "steps": self.steps(), "best": None, "latest": None,
                 "wall_s": round(sum(a.get("wall_s", 0.0) for a in record["attempts"]), 1),
                 "devices": sorted({a["device"] for a in record["attempts"] if a.get("device")}),
                 "done": "result" in record}
        if self.last.exists():
            entry["metric"], entry["best"] = best_score(self.last)
            entry["latest"] = latest_logged(self.dir, f"val/{entry['metric']}")
        fit_s = sum(a.get("wall_s", 0.0) for a in record["attempts"] if a.get("stage") == "fit")
        entry["steps_per_s"] = round(entry["steps"] / fit_s, 1) if fit_s and entry["steps"] else None
        return entry


# --------------------------------------------------------------------------------------------
# The grid
# --------------------------------------------------------------------------------------------
class Grid:
    def __init__(self, args: argparse.Namespace, overrides: list[str]) -> None:
        self.recipe_args = [a for config in args.config for a in ("--config", config)] + overrides
        self.name = args.name or default_name(self.recipe_args)
        self.dir = args.runs_dir / self.name
        self.results, self.table = args.results, args.table or args.results.with_suffix(".md")
        self.runs = [Run(self, arm, seed) for seed in args.seeds for arm in args.arms]
        self.jobs = args.jobs
        self.time_budget, self.slice = args.time_budget, args.slice
        self.started = time.monotonic()  # the time budget counts from here
        self.threads_per_job = args.threads_per_job
        self.commit = code_commit()
        self.device = describe_device(args.jobs, args.threads_per_job)
        self.budget = " ".join(self.recipe_args)
        self.child_env = dict(os.environ)
        if args.threads_per_job:
            for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
                self.child_env[var] = str(args.threads_per_job)
        self.recipe_backbone: dict[str, Any] = {}  # set by resolve_recipe()
        self.max_steps = -1  # the recipe's trainer.max_steps, set by resolve_recipe()
        self._results_lock, self._log_lock = threading.Lock(), threading.Lock()

    def log(self, message: str) -> None:
        with self._log_lock:  # one line per message from the parallel runs
            print(f"[{now()}] {message}", flush=True)

    def resolve_recipe(self, prepare_data: bool) -> None:
        """Parse the recipe once: its ``model.backbone`` (the arms are merged into it) and its
        step budget; a run directory started with other arguments is refused then, before any
        work; when runs remain, the data is built here before parallel runs would race to build
        it."""
        from graphormer_urpe.training.cli import build_cli

        sys.argv = sys.argv[:1]  # the recipe travels as `args`; LightningCLI must not read ours
        cli = build_cli([*self.recipe_args, "--trainer.logger", "false",
                         "--trainer.default_root_dir", str(self.dir)], run=False)
        self.recipe_backbone = backbone_overrides(cli.config.model.backbone)
        self.max_steps = cli.trainer.max_steps
        if self.time_budget and self.max_steps < 1:
            raise ValueError("--time-budget needs a step budget (trainer.max_steps) to tell when a run is done")
        for run in self.runs:
            if run.record_path.exists():
                run.load_record()
        if prepare_data:
            cli.datamodule.prepare_data()

    def _finish(self, run: Run, seconds: float | None = None) -> dict | None:
        result = run.execute(seconds)
        if result is None:
            return None
        with self._results_lock:
            merge_results(self.results, [result])
            write_table(self.results, self.table)
        metric = metric_of(result)
        self.log(f"{run.label}: val {metric} {result[f'val_{metric}']:.4f}, test {metric} "
                 f"{result[f'test_{metric}']:.4f}"
                 f" ({result['steps']} steps, {result['wall_s'] / 60:.1f} min)")
        return result

    def lock(self) -> None:
        """Hold every run directory of this grid until the process ends
        (:func:`~graphormer_urpe.files.hold_directory` on :data:`LOCK_FILE`); ``ValueError`` when
        another runner holds one."""
        self._locks = [hold_directory(run.dir, LOCK_FILE, "graphormer-urpe-ablation",
                                      "wait for it to end, or choose another --name or --runs-dir")
                       for run in self.runs]

    def release(self) -> None:
        """Let go of the run directories :meth:`lock` holds (a process that goes on after
        :func:`main`, such as a test, must not keep them)."""
        for handle in getattr(self, "_locks", ()):
            handle.close()
        self._locks = []

    def check_checkpoints(self) -> None:
        """``ValueError`` (one line) for a damaged or crafted ``last.ckpt`` of an unfinished run
        (read as plain data, :func:`checkpoint_step`), which it resumes or tests from: before the
        recipe is parsed."""
        for run in self.runs:
            if run.last.exists() and "result" not in read_json(run.record_path, {}):
                checkpoint_step(run.last)

    def run(self) -> list[dict]:
        self.dir.mkdir(parents=True, exist_ok=True)
        how = (f"slices within {self.time_budget:.0f} s" if self.time_budget else f"{self.jobs} at a time")
        self.log(f"grid {self.name}: {len(self.runs)} runs, {how}, commit {self.commit}")
        self.resolve_recipe(any("result" not in read_json(r.record_path, {}) for r in self.runs))
        if self.time_budget:
            return self.run_slices()
        with ThreadPoolExecutor(max_workers=self.jobs) as pool:
            futures = [pool.submit(self._finish, run) for run in self.runs]
            results, errors = [], []
            for future in futures:
                try:
                    results.append(future.result())
                except Exception as error:  # the other runs go on; report them all at the end
                    errors.append(error)
                    self.log(f"error: {error}")
        if errors:
            raise SystemExit(f"{len(errors)} of {len(self.runs)} runs failed:\n"
                             + "\n".join(str(e) for e in errors))
        return results

    def next_run(self, skip: Sequence[Run] = ()) -> Run | None:
        """The run the next slice trains: of the first seed with unfinished runs (not in
        ``skip``), a trained but untested one, else the one with the fewest steps, on a tie the one
        with the fewest fits (a slice spent starting up moves on to the next arm), then the
        first arm; None when every run is finished."""
        for seed in dict.fromkeys(run.seed for run in self.runs):
            records = {run: read_json(run.record_path, {}) for run in self.runs
                       if run.seed == seed and run not in skip}
            pending = [run for run, record in records.items() if "result" not in record]
            if pending:
                return min(pending, key=lambda run: (not records[run].get("fit_done"), run.steps(), run.fits()))
        return None

    def run_slices(self) -> list[dict]:
        """``--time-budget``: slices of at most ``--slice`` seconds (default: the budget shared
        by the arms) until the budget, counted from the runner's start, is spent or every run is
        finished (see the docstring). A run that fails is reported and left for this
        invocation; the others go on."""
        end = self.started + self.time_budget
        slice_s = self.slice or self.time_budget / len({run.arm for run in self.runs})
        failed: dict[Run, Exception] = {}
        while (run := self.next_run(list(failed))) is not None:
            left = end - time.monotonic()
            if left < MIN_SLICE_S:
                self.log(f"{self.name}: the time budget is spent ({left:.0f} s left)")
                break
            try:
                self._finish(run, min(slice_s, left))
            except RuntimeError as error:  # a fit or test that failed: named, the grid goes on
                failed[run] = error
                self.log(f"error: {error}")
        if failed:
            raise SystemExit(f"{len(failed)} of {len(self.runs)} runs failed:\n"
                             + "\n".join(str(e) for e in failed.values()))
        return [r["result"] for r in (read_json(run.record_path, {}) for run in self.runs) if "result" in r]

    def progress(self) -> list[dict]:
        return [run.progress() for run in self.runs]


def backbone_overrides(backbone: Any) -> dict[str, Any]:
    """The recipe's ``model.backbone`` as a plain dict of the keys it sets: a dict, or a typed
    config (a parsed namespace or a dataclass with ``as_dict``) whose unset fields are None."""
    if backbone is None:
        return {}
    if hasattr(backbone, "as_dict"):
        backbone = backbone.as_dict()
    elif dataclasses.is_dataclass(backbone):
        backbone = dataclasses.asdict(backbone)
    return {key: value for key, value in dict(backbone).items() if value is not None}


def default_name(recipe_args: Sequence[str]) -> str:
    """``<config stems>-<hash of the recipe arguments>``: one name per distinct recipe (arguments
    that only say how the steps run, such as ``--model.compile``, leave it as it is)."""
    from graphormer_urpe.training.cli import training_args

    stems = [Path(a).stem for prev, a in zip(recipe_args, recipe_args[1:]) if prev == "--config"]
    digest = hashlib.sha256("\0".join(training_args(list(recipe_args))).encode()).hexdigest()[:8]
    return "+".join(stems or ["recipe"]) + f"-{digest}"


# --------------------------------------------------------------------------------------------
def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="graphormer-urpe-ablation", description=__doc__.split("\n\n")[0],
        allow_abbrev=False,  # "--seed" must not pass for "--seeds"
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Other arguments (e.g. --trainer.max_steps 1570) go to every fit and test.")
    parser.add_argument("--config", action="append", default=None,
                        help="recipe config file, repeatable, in order (default: configs/zinc.yaml)")
    parser.add_argument("--arms", nargs="+", choices=sorted(ARMS), default=["urpe", "rpe"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--name", default=None,
                        help="recipe name: run directory and the results' 'recipe' field "
                             "(default: config stems + a hash of the recipe arguments)")
    parser.add_argument("--runs-dir", type=Path, default=Path("runs/ablation"))
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS,
                        help="JSON list of runs, merged into")
    parser.add_argument("--table", type=Path, default=None,
                        help="markdown table (default: the results path with .md)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (without --time-budget)")
    parser.add_argument("--threads-per-job", type=int, default=None,
                        help="OMP/MKL threads of each run (CPU); default: torch's choice")
    parser.add_argument("--time-budget", type=_duration, default=None, metavar="DURATION",
                        help="train in time slices for this long (e.g. 9m), then stop; the same "
                             "command continues (see the description)")
    parser.add_argument("--slice", type=_duration, default=None, metavar="DURATION",
                        help="with --time-budget: the longest slice of one run (default: the "
                             "budget shared by the arms)")
    parser.add_argument("--table-only", action="store_true",
                        help="only rewrite the table from the results file")
    parser.add_argument("--readme", type=Path, default=None, metavar="FILE",
                        help="also write this recipe's result and progress tables into FILE (see "
                             "the description)")
    parser.add_argument("--figures", type=Path, default=None, metavar="DIR",
                        help="after the grid, plot B and C of the best-validation URPE run and "
                             "B of RPE with the same seed to DIR/<name>-tables.png")
    args, overrides = parser.parse_known_args(argv)
    args.config = args.config or ["configs/zinc.yaml"]
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.threads_per_job is not None and args.threads_per_job < 1:
        parser.error(f"--threads-per-job must be >= 1, got {args.threads_per_job}")
    bad_seeds = [seed for seed in args.seeds if not 0 <= seed <= MAX_SEED]
    if bad_seeds:
        parser.error(f"--seeds must be integers from 0 to {MAX_SEED} (2**32 - 1), got {bad_seeds}")
    if len(set(args.seeds)) != len(args.seeds) or len(set(args.arms)) != len(args.arms):
        parser.error("--seeds and --arms must not repeat a value")
    if args.slice and not args.time_budget:
        parser.error("--slice divides a --time-budget: add --time-budget")
    if args.slice is not None and args.slice < MIN_SLICE_S:
        parser.error(f"--slice must be at least {MIN_SLICE_S:.0f} s (a fit needs seconds to start), got {args.slice:.0f} s")
    if args.time_budget and args.jobs != 1:
        parser.error("--time-budget trains one slice at a time: drop --jobs")
    if args.readme and args.table_only and not args.name:
        parser.error("--readme with --table-only needs --name")
    stray = [a for a in overrides if a.startswith("--") and not a.startswith(
        ("--trainer.", "--model.", "--data.", "--checkpoint.", "--lr_monitor."))]
    if stray:
        parser.error(f"unknown arguments {stray}: only LightningCLI overrides (--trainer.*, "
                     "--model.*, --data.*, --checkpoint.*) are passed through")
    return args, overrides


class Stopped(BaseException):
    """SIGTERM to the runner (a job scheduler, ``timeout``): raised where it waits."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _sigterm_stops():
    """While the grid runs, SIGTERM raises :class:`Stopped` (the runner stops its fit, which saves
    its state, writes the progress and exits 143) instead of ending the process at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise Stopped(signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _refuse(error: Exception) -> SystemExit:
    print(f"graphormer-urpe-ablation: error: {error}", file=sys.stderr)
    return SystemExit(2)


def main(argv: Sequence[str] | None = None) -> None:
    """The command (returns None: a console script exits with main()'s value)."""
    args, overrides = parse_args(argv)
    start = time.perf_counter()
    try:
        read_results(args.results)  # a damaged file is reported now, not after the runs
        if not args.table_only:  # results, tables and the README are written after the runs
            check_writable_dir(args.results.parent, "--results")
            for option, path in (("--table", args.table), ("--readme", args.readme)):
                if path is not None:
                    check_writable_dir(path.parent, option)
            check_creatable_dir(args.runs_dir, "--runs-dir")
    except ValueError as error:
        raise _refuse(error) from None
    with contextlib.ExitStack() as held:  # the run directories are let go when main() ends
        if args.table_only:
            results = read_json(args.results, [])
            print(write_table(args.results, args.table or args.results.with_suffix(".md")))
        else:
            grid = Grid(args, overrides)
            try:
                if args.readme:  # a missing block is said now, not after training
                    readme_block(args.readme, grid.name)
                    readme_block(args.readme, grid.name, "ablation-progress")
                held.callback(grid.release)
                grid.lock()
                grid.check_checkpoints()
            except ValueError as error:
                raise _refuse(error) from None
            if args.readme:  # however the grid ends, where it stands
                held.callback(lambda: write_progress_block(args.readme, grid.name, grid.progress(),
                                                           grid.max_steps))
            try:
                with _sigterm_stops():
                    results = grid.run()
            except ValueError as error:  # the recipe refused by the training CLI's parser
                raise _refuse(error) from None
            except (KeyboardInterrupt, Stopped) as stop:  # the fit in progress saved and stopped
                signum = getattr(stop, "signum", signal.SIGINT)
                print(f"graphormer-urpe-ablation: stopped by {signal.Signals(signum).name}; every run "
                      "keeps its last.ckpt: the same command continues", file=sys.stderr, flush=True)
                raise SystemExit(128 + signum) from None
            print(write_table(grid.results, grid.table))
        if args.readme:
            write_readme_block(args.readme, args.name or grid.name, read_json(args.results, []))
        if args.figures and results:
            chosen = [e for e in results if args.name in (None, e.get("recipe"))]
            from graphormer_urpe.plot import plot_learned_tables  # matplotlib only when plotting

            print(plot_learned_tables(chosen, args.runs_dir, args.figures))
    if not args.table_only:
        print(f"graphormer-urpe-ablation: {grid.name} took {(time.perf_counter() - start) / 60:.1f} "
              f"min ({len(results)} runs finished)")


if __name__ == "__main__":
    main()

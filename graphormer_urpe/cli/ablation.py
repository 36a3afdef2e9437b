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
  for regression, see :mod:`graphormer_urpe.data.task`) and that checkpoint is evaluated on
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
``<!-- /ablation-progress:NAME -->``, after every invocation, also one stopped by a signal. The
rest of FILE is the user's: it is read when a block is written.

Several GPUs: one invocation per GPU (``CUDA_VISIBLE_DEVICES=i``, its own ``--seeds``) with the
same ``--name``, ``--results`` and ``--readme`` (build the data first, e.g. with one finished
run). The results, the table and the README's blocks are rebuilt under locks from every run of
the grid on disk, whichever invocation trained it.

Every output is checked before any work: not a file the runner reads nor another output, and
writable; so are the files it reads (results, README, run records, the checkpoints it resumes
or reports): one line and exit status 2 otherwise.

Arguments this runner does not know are passed to every ``fit`` and ``test`` unchanged.
Run it again with the same arguments to continue a killed grid.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import hashlib
import importlib.util
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
from typing import IO, Any, Callable, Sequence

from graphormer_urpe.training.studies.ablation_results import (
    DEFAULT_RESULTS, code_commit, describe_device, entry_problem, is_number, metric_of, now,
    publish_results, read_results, readme_block, write_progress_block,
    write_readme_block, write_table)
from graphormer_urpe.utils.files import (
    check_creatable_dir, check_writable_dir, hold_directory, read_json, refuse_overwriting_inputs,
    write_json, written_in_place)
from graphormer_urpe.training.recipes import resolve_config

#: What each arm changes in the recipe's ``model.backbone`` (merged into it; everything else in
#: the backbone, e.g. a smaller model, stays as the recipe has it).
ARMS: dict[str, dict[str, Any]] = {
    "urpe": {"attention": "urpe", "share_urpe_scale": False},
    "rpe": {"attention": "rpe"},
    "urpe-shared": {"attention": "urpe", "share_urpe_scale": True},
}
RUN_RECORD = "ablation_run.json"
#: The name of a run directory: ``<arm>-s<seed>``.
RUN_DIR = re.compile(rf"(?P<arm>{'|'.join(map(re.escape, ARMS))})-s(?P<seed>0|[1-9][0-9]*)")
#: In a run directory: held (``fcntl.flock``) by the runner that trains it, and names its pid.
LOCK_FILE = "ablation.lock"
#: The lock files this process holds (:meth:`Grid.lock`), which a forked child lets go of.
_HELD_LOCKS: list[IO] = []
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


def checkpoint_state(path: Path) -> tuple[int, str, float | None]:
    """``(steps, metric, best validation score)`` that a run's ``last.ckpt`` records: its
    ``global_step``, its task's metric and its checkpoint callback's ``best_model_score`` (None
    before the first validation). Read as plain data; ``ValueError`` naming the file for one that
    is damaged, crafted, or lacks them."""
    from graphormer_urpe.utils.torch_files import model_checkpoint_state, read_checkpoint
    from graphormer_urpe.data.facts import DataFacts
    from graphormer_urpe.data.task import get_task

    checkpoint = read_checkpoint(path)
    try:
        steps = int(checkpoint["global_step"])
        task = get_task(DataFacts.recorded(checkpoint.get("hyper_parameters", {}), "task"))
        state = model_checkpoint_state(checkpoint, task.monitor) or {}
        score = None if state.get("best_model_score") is None else float(state["best_model_score"])
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise ValueError(f"checkpoint {path} is not a run's last.ckpt ({type(error).__name__}: "
                         f"{error}); remove it to start the run over") from None
    return steps, task.metric_name, score


def checkpoint_step(path: Path) -> int:
    """The optimizer steps a checkpoint holds (its ``global_step``)."""
    return checkpoint_state(path)[0]


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

    def read_record(self) -> dict | None:
        """The run record as stored (None without one); ``ValueError`` naming the file when it is
        not a run record (:func:`record_problem`)."""
        if not self.record_path.exists():
            return None
        record = read_json(self.record_path, None)
        problem = record_problem(record)
        if problem:
            raise ValueError(f"{self.record_path}: not a run record ({problem}); fix it or remove "
                             "the run directory")
        return record

    def load_record(self) -> dict:
        """The run record (a new one without one); ``ValueError`` when it is not one or the run
        was started with other arguments."""
        record = self.read_record()
        if record is None:
            return {"cli_args": self.cli_args, "commit": self.grid.commit, "attempts": []}
        from graphormer_urpe.training.lightning_cli import training_args

        if training_args(record["cli_args"]) != training_args(self.cli_args):
            raise ValueError(f"{self.dir} was started with other arguments ({' '.join(record['cli_args'])}; "
                             f"now {' '.join(self.cli_args)}): choose another --name or remove it")
        return record

    def steps(self) -> int:
        """The optimizer steps its ``last.ckpt`` holds (0 without one)."""
        return checkpoint_step(self.last) if self.last.exists() else 0

    def fits(self) -> int:
        """The ``fit`` attempts its record holds."""
        return sum(a["stage"] == "fit" for a in (self.read_record() or {"attempts": []})["attempts"])

    def _subprocess(self, stage: str, args: list[str], record: dict, seconds: float | None = None) -> dict:
        """``graphormer-urpe <stage> args`` with its output appended to ``<stage>.log``; the
        attempt's wall time is kept up to date in the run record (a kill loses < HEARTBEAT_S).
        With ``seconds``, the command gets SIGTERM after that long (the end of a slice: a fit
        saves its state and stops). The attempt (its record entry)."""
        command = [sys.executable, "-m", "graphormer_urpe.cli.fit", stage, *args]
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
        metric, device time (every attempt's wall time), steps per second of that time, devices.
        A finished run's steps and best come from its result, an unfinished one's from its
        ``last.ckpt``."""
        record = self.read_record() or {"attempts": []}
        result = record.get("result")
        entry = {"run": f"{self.arm}-s{self.seed}", "steps": 0, "best": None, "latest": None,
                 "wall_s": round(sum(a["wall_s"] for a in record["attempts"]), 1),
                 "devices": sorted({a["device"] for a in record["attempts"] if a.get("device")}),
                 "done": result is not None}
        if result is not None:
            entry["metric"] = metric_of(result)
            entry["steps"], entry["best"] = result["steps"], result[f"val_{entry['metric']}"]
        elif self.last.exists():
            entry["steps"], entry["metric"], entry["best"] = checkpoint_state(self.last)
        if "metric" in entry:
            entry["latest"] = latest_logged(self.dir, f"val/{entry['metric']}")
        fit_s = sum(a["wall_s"] for a in record["attempts"] if a["stage"] == "fit")
        entry["steps_per_s"] = round(entry["steps"] / fit_s, 1) if fit_s and entry["steps"] else None
        return entry


def record_problem(record: Any) -> str | None:
    """What keeps ``record`` from being a run record (:data:`RUN_RECORD`: its arguments, its
    attempts, each with its stage, commit and wall time, and the result of a finished run), in
    words; None for one."""
    if not isinstance(record, dict):
        return f"a JSON {'null' if record is None else type(record).__name__}, not an object"
    arguments = record.get("cli_args")
    if not (isinstance(arguments, list) and all(isinstance(a, str) for a in arguments)):
        return "cli_args is not a list of arguments"
    attempts = record.get("attempts")
    if not isinstance(attempts, list):
        return "attempts is not a list"
    for index, attempt in enumerate(attempts):
        if not (isinstance(attempt, dict) and isinstance(attempt.get("stage"), str)
                and isinstance(attempt.get("commit"), str) and is_number(attempt.get("wall_s"))):
            return f"attempt {index} lacks its stage, commit or wall_s"
    if "result" in record and entry_problem(record["result"]):
        return f"its result: {entry_problem(record['result'])}"
    return None


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
        from graphormer_urpe.training.lightning_cli import build_cli

        sys.argv = sys.argv[:1]  # the recipe travels as `args`; LightningCLI must not read ours
        cli = build_cli([*self.recipe_args, "--trainer.logger", "false",
                         "--trainer.default_root_dir", str(self.dir)], run=False)
        self.recipe_backbone = backbone_overrides(cli.config.model.backbone)
        self.max_steps = cli.trainer.max_steps
        if self.time_budget and self.max_steps < 1:
            raise ValueError("--time-budget needs a step budget (trainer.max_steps) to tell when a run is done")
        for run in self.all_runs():  # the grid's runs on disk are of one recipe
            run.load_record()
        if prepare_data:
            cli.datamodule.prepare_data()

    def all_runs(self) -> list[Run]:
        """This invocation's runs and every other run of the grid on disk (a run directory with
        a run record: the seeds or arms of another invocation, e.g. one per GPU), by seed, then
        arm."""
        runs = {(run.arm, run.seed): run for run in self.runs}
        for record in self.dir.glob(f"*-s*/{RUN_RECORD}"):
            match = RUN_DIR.fullmatch(record.parent.name)
            if match and (match["arm"], int(match["seed"])) not in runs:
                runs[match["arm"], int(match["seed"])] = Run(self, match["arm"], int(match["seed"]))
        return sorted(runs.values(), key=lambda run: (run.seed, list(ARMS).index(run.arm)))

    def publish(self) -> str:
        """Merge the result of every finished run of the grid on disk (this invocation's and any
        other's) into the results file and rewrite the table, under the results' lock; the table."""
        finished = [record["result"] for record in (run.read_record() for run in self.all_runs())
                    if record and "result" in record]
        with self._results_lock:
            return publish_results(self.results, self.table, finished)

    def _finish(self, run: Run, seconds: float | None = None) -> dict | None:
        result = run.execute(seconds)
        if result is None:
            return None
        self.publish()
        metric = metric_of(result)
        self.log(f"{run.label}: val {metric} {result[f'val_{metric}']:.4f}, test {metric} "
                 f"{result[f'test_{metric}']:.4f}"
                 f" ({result['steps']} steps, {result['wall_s'] / 60:.1f} min)")
        return result

    def lock(self) -> None:
        """Hold every run directory of this grid until the process ends
        (:func:`~graphormer_urpe.utils.files.hold_directory` on :data:`LOCK_FILE`); ``ValueError`` when
        another runner holds one."""
        self._locks = [hold_directory(run.dir, LOCK_FILE, "graphormer-urpe-ablation",
                                      "wait for it to end, or choose another --name or --runs-dir")
                       for run in self.runs]
        _HELD_LOCKS.extend(self._locks)

    def release(self) -> None:
        """Let go of the run directories :meth:`lock` holds (a process that goes on after
        :func:`main`, such as a test, must not keep them)."""
        for handle in getattr(self, "_locks", ()):
            _HELD_LOCKS.remove(handle)
            handle.close()
        self._locks = []

    def check_runs(self, reported: bool) -> None:
        """``ValueError`` (one line) before any work for what this invocation reads later: a run
        record that is not one, of any run of the grid on disk, and a damaged or crafted
        ``last.ckpt`` (read as plain data, :func:`checkpoint_state`) of an unfinished run that
        it resumes or, when ``reported`` (``--readme``'s progress table), of any unfinished
        run of the grid."""
        for run in self.all_runs():
            record = run.read_record() or {}
            if run.last.exists() and "result" not in record and (reported or run in self.runs):
                checkpoint_state(run.last)

    def run(self) -> list[dict]:
        self.dir.mkdir(parents=True, exist_ok=True)
        how = (f"slices within {self.time_budget:.0f} s" if self.time_budget else f"{self.jobs} at a time")
        self.log(f"grid {self.name}: {len(self.runs)} runs, {how}, commit {self.commit}")
        self.resolve_recipe(any("result" not in (r.read_record() or {}) for r in self.runs))
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
            records = {run: run.read_record() or {} for run in self.runs
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
        slice_s = self.slice or max(self.time_budget / len({run.arm for run in self.runs}), MIN_SLICE_S)
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
        return [r["result"] for r in (run.read_record() or {} for run in self.runs) if "result" in r]

    def progress(self) -> list[dict]:
        """:meth:`Run.progress` of every run of the grid on disk (:meth:`all_runs`)."""
        return [run.progress() for run in self.all_runs()]

    def figure(self, figures: Path) -> str:
        """B and C of the grid's best-validation URPE run among all its finished runs in the
        results file, and B of RPE with the same seed, in ``figures``; its path, or why there
        is none yet."""
        entries = [e for e in read_results(self.results) if e.get("recipe") == self.name]
        if not any(e["attention"] == "urpe" for e in entries):
            return f"no figure yet: no urpe run of {self.name} has finished"
        from graphormer_urpe.training.studies.learned_tables import plot_learned_tables  # matplotlib only when plotting

        return str(plot_learned_tables(entries, self.dir.parent, figures))


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
    from graphormer_urpe.training.lightning_cli import training_args

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
                        help="a packaged recipe's name or a config file, repeatable, in order (default: zinc)")
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
    args.config = args.config or ["zinc"]
    for config in args.config:  # names stay names: each fit reads the recipe of its own install
        try:
            resolve_config(config)
        except ValueError as error:
            parser.error(str(error))
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
    for option, seconds in (("--time-budget", args.time_budget), ("--slice", args.slice)):
        if seconds is not None and seconds < MIN_SLICE_S:
            parser.error(f"{option} must be at least {MIN_SLICE_S:.0f} s (the shortest slice: a fit needs "
                         f"seconds to start), got {seconds:.0f} s")
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


def _stop_the_grid(signum: int, frame: Any) -> None:
    raise Stopped(signum)


@contextlib.contextmanager
def _sigterm_stops():
    """While the grid runs, SIGTERM raises :class:`Stopped` (the runner stops its fit, which saves
    its state, writes the progress and exits 143) instead of ending the process at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _stop_the_grid)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _in_a_forked_child() -> None:
    """A process forked by the runner (a worker of the pool that builds the data) is not the
    runner: SIGTERM and Ctrl-C end it as they end any process (the pool's end sends its workers
    SIGTERM, and the runner's handler, which raises :class:`Stopped` to stop the grid, would print
    a traceback from each worker), and it lets go of its copies of the run directories' locks (a
    worker that outlived the runner would hold them). A fit is a new program: ``exec`` resets
    the handlers, and it inherits no lock."""
    if signal.getsignal(signal.SIGTERM) is _stop_the_grid:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    if _HELD_LOCKS:
        null = os.open(os.devnull, os.O_RDONLY)
        for handle in _HELD_LOCKS:  # the open file stays valid; the lock is the runner's alone
            os.dup2(null, handle.fileno())
        os.close(null)


os.register_at_fork(after_in_child=_in_a_forked_child)


def _refuse(error: Exception) -> SystemExit:
    print(f"graphormer-urpe-ablation: error: {error}", file=sys.stderr)
    return SystemExit(2)


def check_output(option: str, path: Path) -> None:
    """One-line ``ValueError`` naming ``option`` unless ``path`` can be written as the runner
    writes its outputs (a new file renamed onto it): its folder takes a new file, and it is not a
    directory or a file that cannot be replaced (immutable, read-only to this user)."""
    if path.is_dir():
        raise ValueError(f"{option} {path} is a directory; name the file to write")
    check_writable_dir(Path(os.path.realpath(path)).parent if path.is_symlink() else path.parent, option)
    if path.exists() and not written_in_place(path):
        try:
            open(path, "ab").close()  # nothing is written: opening for writing is the test
        except OSError as error:
            raise ValueError(f"{option} {path} cannot be written ({error.strerror or error})") from None


def check_files(args: argparse.Namespace, table: Path, figure: Path | None) -> None:
    """One-line ``ValueError`` before any work for the files the invocation reads and writes: the
    results (a list of runs) and the README (UTF-8 text with the recipe's markers) it reads, and
    every output (``--results``, ``--table``, the README's blocks, the ``--figures`` file) that is
    a file it reads (a ``--config``, with ``--table-only`` the results) or another output,
    however spelled (:func:`~graphormer_urpe.utils.files.same_file`: links too), or that cannot be
    written (:func:`check_output`)."""
    outputs = [] if args.table_only else [("--results", "results file", args.results)]
    outputs.append(("--table" if args.table else "the default --table", "table", table))
    if args.readme:
        outputs.append(("--readme", "README", args.readme))
    if figure is not None:
        outputs.append(("--figures", "figure", figure))
    inputs = [("--config", "recipe config", config) for config in args.config if os.path.isfile(config)]
    if args.table_only:
        inputs.append(("--results", "results file", args.results))
    for index, (option, _, path) in enumerate(outputs):
        refuse_overwriting_inputs(option, [path], [*inputs, *outputs[:index]])
    if figure is not None:
        if importlib.util.find_spec("matplotlib") is None:
            raise ValueError("--figures needs matplotlib: pip install 'graphormer-urpe[plot]'")
        check_writable_dir(args.figures, "--figures")
    for option, _, path in outputs:
        check_output(option, path)
    read_results(args.results)
    if args.readme:
        readme_block(args.readme, args.name)
        if not args.table_only:
            readme_block(args.readme, args.name, "ablation-progress")


def figure_of(entries: Sequence[dict], figures: Path) -> Path:
    """The file :func:`~graphormer_urpe.training.studies.learned_tables.plot_learned_tables` writes for ``entries``: of the
    recipe of the best-validation URPE run. ``ValueError`` when no URPE run has finished."""
    urpe = [e for e in entries if e["attention"] == "urpe"]
    if not urpe:
        raise ValueError("--figures plots a finished urpe run, and there is none"
                         + (f" of {entries[0].get('recipe')}" if entries else ""))
    best = min(urpe, key=lambda e: e[f"val_{metric_of(e)}"])
    return figures / f"{best.get('recipe')}-tables.png"


def _late(problems: list[str], write: Callable[[], Any]) -> Any:
    """``write()``, done after the runs; a failure (the README's markers removed meanwhile, a full
    disk, a file made read-only) is said in one line and added to ``problems``, and the other
    outputs are still written."""
    try:
        return write()
    except (ValueError, OSError) as error:
        message = f"graphormer-urpe-ablation: error: {error}"
        print(message, file=sys.stderr, flush=True)
        problems.append(message)
        return None


def table_only(args: argparse.Namespace) -> None:
    """``--table-only``: the table, the README's result block and the figure from the results
    file alone."""
    table = args.table or args.results.with_suffix(".md")
    try:
        chosen = [e for e in read_results(args.results) if args.name in (None, e.get("recipe"))]
        check_files(args, table, figure_of(chosen, args.figures) if args.figures else None)
    except ValueError as error:
        raise _refuse(error) from None
    print(write_table(args.results, table))
    if args.readme:
        write_readme_block(args.readme, args.name, args.results)
    if args.figures:
        from graphormer_urpe.training.studies.learned_tables import plot_learned_tables  # matplotlib only when plotting

        print(plot_learned_tables(chosen, args.runs_dir, args.figures))


def main(argv: Sequence[str] | None = None) -> None:
    """The command (returns None: a console script exits with main()'s value)."""
    args, overrides = parse_args(argv)
    if args.table_only:
        return table_only(args)
    start = time.perf_counter()
    problems: list[str] = []
    with contextlib.ExitStack() as held:  # the run directories are let go when main() ends
        try:
            grid = Grid(args, overrides)
            args.name = grid.name
            check_files(args, grid.table, args.figures and args.figures / f"{grid.name}-tables.png")
            check_creatable_dir(args.runs_dir, "--runs-dir")
            held.callback(grid.release)
            grid.lock()
            grid.check_runs(reported=bool(args.readme))
        except ValueError as error:
            raise _refuse(error) from None
        if args.readme:  # however the grid ends, where all its runs stand
            held.callback(_late, problems, lambda: write_progress_block(
                args.readme, grid.name, grid.progress, grid.max_steps))
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
        table = _late(problems, grid.publish)
        if table is not None:
            print(table)
        if args.readme:
            _late(problems, lambda: write_readme_block(args.readme, grid.name, args.results))
        if args.figures:
            _late(problems, lambda: print(grid.figure(args.figures)))
    print(f"graphormer-urpe-ablation: {grid.name} took {(time.perf_counter() - start) / 60:.1f} "
          f"min ({len(results)} runs finished)")
    if problems:
        raise SystemExit(1)


if __name__ == "__main__":
    main()

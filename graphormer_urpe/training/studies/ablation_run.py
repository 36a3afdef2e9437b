"""One run of the seeded ablation (``graphormer-urpe-ablation``): an ``(arm, seed)`` of a
:class:`~graphormer_urpe.training.studies.ablation.Grid` and its run directory.

A run lives in ``<runs-dir>/<name>/<arm>-s<seed>/`` with its logs, checkpoints and
:data:`RUN_RECORD` (its arguments, commit, attempts and result). It is trained by ``fit`` and
tested by ``test``, each a subprocess of ``graphormer-urpe``
(:func:`~graphormer_urpe.utils.process.console_command`: the current folder is not on its import
path) with the recipe, the arm's backbone and the seed; it resumes from its
``checkpoints/last.ckpt`` (its steps are the checkpoint's ``global_step``), and once it has a
result it is not redone. A time slice ends with
SIGTERM to its ``fit``, which saves the run's whole state in ``last.ckpt`` and stops.
"""
from __future__ import annotations

import csv
import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Protocol

from graphormer_urpe.training.studies.ablation_results import entry_problem, is_number, metric_of, now
from graphormer_urpe.utils.files import read_json, write_json
from graphormer_urpe.utils.process import console_command, tied_to_parent

#: What each arm changes in the recipe's ``model.backbone`` (merged into it; everything else in
#: the backbone, e.g. a smaller model, stays as the recipe has it).
ARMS: dict[str, dict[str, Any]] = {
    "urpe": {"attention": "urpe", "share_urpe_scale": False},
    "rpe": {"attention": "rpe"},
    "urpe-shared": {"attention": "urpe", "share_urpe_scale": True},
}
RUN_RECORD = "ablation_run.json"
#: Seconds between updates of a running attempt's wall time in its run record.
HEARTBEAT_S = 15.0
#: Seconds a ``fit`` has to save and stop after its SIGTERM (the step in progress, a validation,
#: the checkpoint) before it is killed.
STOP_GRACE_S = 180.0
#: Exit statuses of a ``fit`` stopped by the SIGTERM that ends its slice (the CLI's 128 + 15, or
#: the signal itself when it came before the CLI handles it).
SLICE_END_STATUSES = (128 + signal.SIGTERM, -signal.SIGTERM)


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



class Grid(Protocol):
    """What a run reads of its grid (:class:`graphormer_urpe.training.studies.ablation.Grid`)."""

    name: str  # the recipe's name: the grid's folder and the results' ``recipe``
    dir: Path  # the grid's folder, which holds the run directories
    recipe_args: list[str]  # configs and overrides of every fit and test
    recipe_backbone: dict[str, Any]  # the recipe's ``model.backbone``, which the arm changes
    max_steps: int  # the recipe's ``trainer.max_steps`` (< 1: none)
    budget: str  # the recipe in words, for the results
    commit: str  # the commit of the code that trains
    device: str  # what it trains on, in words
    child_env: dict[str, str]  # the environment of the fits and tests

    def log(self, message: str) -> None: ...


class Run:
    """One ``(arm, seed)`` of the grid and its run directory."""

    def __init__(self, grid: Grid, arm: str, seed: int) -> None:
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
        return checkpoint_state(self.last)[0] if self.last.exists() else 0

    def fits(self) -> int:
        """The ``fit`` attempts its record holds."""
        return sum(a["stage"] == "fit" for a in (self.read_record() or {"attempts": []})["attempts"])

    def _subprocess(self, stage: str, args: list[str], record: dict, seconds: float | None = None) -> dict:
        """``graphormer-urpe <stage> args`` with its output appended to ``<stage>.log``; the
        attempt's wall time is kept up to date in the run record (a kill loses < HEARTBEAT_S).
        With ``seconds``, the command gets SIGTERM after that long (the end of a slice: a fit
        saves its state and stops). The attempt (its record entry)."""
        command = [*console_command("graphormer-urpe", "graphormer_urpe.cli.fit"), stage, *args]
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
                                       env=self.grid.child_env,
                                       preexec_fn=tied_to_parent(signal.SIGKILL))
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

"""The seeded URPE-vs-RPE ablation (``graphormer-urpe-ablation``, docs/ablation.md): a grid of
arms x seeds on one recipe, an Optuna study on the search's machinery (:mod:`.study`). Each point
``(arm, seed)`` is the run directory ``<runs-dir>/<name>/<arm>-s<seed>/``, trained (from its
``last.ckpt``) and tested by trials until one completes; a runner holds :data:`LOCK_FILE` in each.
"""
from __future__ import annotations

import csv
import dataclasses
import hashlib
import json
import os
import re
import time
from pathlib import Path
from typing import Any, Sequence

from graphormer_urpe.training.studies.ablation_results import (
    code_commit, describe_device, metric_of, publish_results)
from graphormer_urpe.training.studies.study import (
    STUDY_DB, connect, fail_and_queue_again, fail_dead_trials, launch, now, objective, parse_fit, recipe_args,
    worker)
from graphormer_urpe.utils.files import hold_directory

#: What each arm changes in the recipe's ``model.backbone`` (merged into it; everything else in
#: the backbone, e.g. a smaller model, stays as the recipe has it).
ARMS: dict[str, dict[str, Any]] = {
    "urpe": {"attention": "urpe", "share_urpe_scale": False},
    "rpe": {"attention": "rpe"},
    "urpe-shared": {"attention": "urpe", "share_urpe_scale": True},
}
#: The name of a run directory: ``<arm>-s<seed>``.
RUN_DIR = re.compile(rf"(?P<arm>{'|'.join(map(re.escape, ARMS))})-s(?P<seed>0|[1-9][0-9]*)")
#: In a run directory: held (a ``filelock`` lock) by the runner that trains it, and names its pid.
LOCK_FILE = "ablation.lock"
#: The seeds ``seed_everything`` takes (numpy's).
MAX_SEED = 2**32 - 1
#: A run's newest saved state, in its run directory (as ``prediction.load`` reads it).
LAST = Path("checkpoints") / "last.ckpt"
#: Exit statuses of a ``fit`` stopped by SIGTERM (the CLI's 128 + 15, or the signal itself).
STOPPED_STATUSES = (143, -15)


class RunFailed(RuntimeError):
    """A run's fit or test failed (its log says why): its trial fails, the grid goes on."""


class Stopped(RuntimeError):
    """The time budget stopped a run's fit (it saved its state): its trial fails."""


class RunsFailed(RuntimeError):
    """Some runs of the grid failed (each named); the others went on."""


class Grid:
    """The runs ``arms x seeds`` of one recipe in ``runs_dir/<name>/``, their results merged into
    ``results`` and ``table``; ``time_budget`` (seconds) stops the grid and the fit in progress."""

    def __init__(self, configs: Sequence[str], overrides: Sequence[str], *, runs_dir: Path,
                 results: Path, arms: Sequence[str], seeds: Sequence[int], name: str | None = None,
                 table: Path | None = None, threads_per_job: int | None = None,
                 time_budget: float | None = None) -> None:
        self.recipe_args = recipe_args(list(configs), list(overrides))
        self.name = name or default_name(self.recipe_args)
        self.dir = runs_dir / self.name
        self.results, self.table = results, table or results.with_suffix(".md")
        self.points = [(arm, seed) for seed in seeds for arm in arms]
        self.deadline = None if time_budget is None else time.monotonic() + time_budget
        self.commit, self.device = code_commit(), describe_device(threads_per_job)
        threads = {var: str(threads_per_job) for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS") if threads_per_job}
        self.child_env = {**os.environ, **threads}
        self.recipe_backbone: dict[str, Any] = {}  # the recipe's, set by open()
        self.max_steps = -1  # the recipe's trainer.max_steps (< 1: none), set by open()
        self.study, self.current, self.failed, self._locks = None, None, [], []

    def log(self, message: str) -> None:
        print(f"[{now()}] {message}", flush=True)

    def run_dir(self, arm: str, seed: int) -> Path:
        return self.dir / f"{arm}-s{seed}"

    def lock(self) -> None:
        """Hold this invocation's run directories (until :meth:`release`); ``ValueError`` when
        another runner holds one."""
        for arm, seed in self.points:
            self._locks.append(hold_directory(self.run_dir(arm, seed), LOCK_FILE, "graphormer-urpe-ablation",
                                              "wait for it to end, or choose another --name or --runs-dir"))

    def release(self) -> None:
        while self._locks:
            self._locks.pop().release()

    def open(self) -> None:
        """Read the recipe (:func:`.study.parse_fit`) and open its study; trials of a gone
        runner of this machine are failed."""
        from graphormer_urpe.training.lightning_cli import training_args

        config = parse_fit([*self.recipe_args, "--trainer.logger", "false",
                            "--trainer.default_root_dir", str(self.dir)])
        self.recipe_backbone = backbone_overrides(config.model.backbone)
        self.max_steps = config.trainer.max_steps
        if self.deadline and self.max_steps < 1:
            raise ValueError("--time-budget needs a step budget (trainer.max_steps) to tell when a run is done")
        self.study = connect(f"sqlite:///{self.dir.absolute() / STUDY_DB}", self.name,
                             {"args": training_args(self.recipe_args)}, {"args": "the recipe's arguments"},
                             lambda: objective(config), self.dir, "--runs-dir", queue_again=False)
        for number in fail_dead_trials(self.study, queue_again=False):
            self.log(f"{self.name}: trial {number} was left running by a runner that is gone; marked failed")

    def trials(self, arm: str, seed: int) -> list:
        return [t for t in self.study.get_trials(deepcopy=False) if t.params == {"arm": arm, "seed": seed}]

    def result(self, arm: str, seed: int) -> dict | None:
        """The run's result (of its complete trial), None before it has one."""
        return next((t.user_attrs["result"] for t in self.trials(arm, seed) if t.state.name == "COMPLETE"), None)

    def all_points(self) -> list[tuple[str, int]]:
        """This invocation's runs and every other of the grid in the study or on disk, by seed, arm."""
        points = set(self.points) | {(t.params["arm"], t.params["seed"]) for t in self.study.get_trials(deepcopy=False)
                                     if set(t.params) == {"arm", "seed"}}
        matches = (RUN_DIR.fullmatch(folder.name) for folder in self.dir.glob("*-s*") if folder.is_dir())
        points |= {(match["arm"], int(match["seed"])) for match in matches if match}
        return sorted(points, key=lambda p: (p[1], list(ARMS).index(p[0])))

    def check_runs(self, reported: bool) -> None:
        """``ValueError`` for a damaged ``last.ckpt`` of an unfinished run this invocation resumes
        (``reported``: of any run of the grid, for the progress table)."""
        for arm, seed in self.all_points():
            last = self.run_dir(arm, seed) / LAST
            if last.exists() and (reported or (arm, seed) in self.points) and self.result(arm, seed) is None:
                checkpoint_state(last)

    def run(self) -> int:
        """Train and test this invocation's runs without a result, a trial each; the number of
        results. :class:`RunsFailed` names the runs that failed, after the others."""
        todo = [point for point in self.points if self.result(*point) is None]
        timeout = None if self.deadline is None else self.deadline - time.monotonic()
        budget = "" if timeout is None else f" within {timeout:.0f} s"
        self.log(f"grid {self.name}: {len(self.points)} runs, {len(todo)} to train{budget}, commit {self.commit}")
        if todo and (timeout is None or timeout > 0):
            queue = iter(todo)
            self.study.optimize(lambda trial: self.train(trial, *next(queue)), n_trials=len(todo), timeout=timeout,
                                catch=(RunFailed, Stopped), callbacks=[self.ended])
        if self.deadline is not None and time.monotonic() >= self.deadline:
            self.log(f"{self.name}: the time budget is spent")
        if self.failed:
            raise RunsFailed(f"{len(self.failed)} of {len(self.points)} runs failed:\n" + "\n".join(self.failed))
        return sum(self.result(*point) is not None for point in self.points)

    def train(self, trial, arm: str, seed: int) -> float:
        """One trial of run ``(arm, seed)``: its fit (resumed from its ``last.ckpt``), then its
        test; the validation score. Why it did not complete is its ``reason``."""
        try:
            return self._train(trial, arm, seed)
        except (RunFailed, Stopped) as error:
            trial.set_user_attr("reason", str(error))
            if isinstance(error, RunFailed):
                self.failed.append(str(error))
            self.log(f"error: {error}" if isinstance(error, RunFailed) else str(error))
            raise

    def _train(self, trial, arm: str, seed: int) -> float:
        import optuna

        from graphormer_urpe.prediction.load import best_checkpoint

        self.current = trial.number
        # the run's values, in distributions every trial of the study shares
        self.study.sampler = optuna.samplers.PartialFixedSampler({"arm": arm, "seed": seed},
                                                                optuna.samplers.RandomSampler())
        trial.suggest_categorical("arm", list(ARMS))
        trial.suggest_int("seed", 0, MAX_SEED)
        run_dir, label = self.run_dir(arm, seed), f"{self.name}/{arm}-s{seed}"
        # the arm's backbone after the recipe: LightningCLI replaces a dict argument, not merges it
        args = [*self.recipe_args, "--model.backbone", json.dumps({**self.recipe_backbone, **ARMS[arm]}),
                "--seed_everything", str(seed), "--data.init_args.seed", str(seed),
                "--trainer.default_root_dir", str(run_dir)]
        for key, value in {"worker": worker(), "commit": self.commit, "device": self.device, "args": args}.items():
            trial.set_user_attr(key, value)
        last = run_dir / LAST
        before = checkpoint_state(last)[0] if last.exists() else 0
        if not 0 < self.max_steps <= before:
            if last.exists():
                resume = ["--ckpt_path", str(last)]
                self.log(f"{label}: fit (resuming from last.ckpt at step {before})")
            else:  # no resumable state: checkpoints of a run killed before its first last.ckpt go
                resume = ["--checkpoint.overwrite", "true"]
                self.log(f"{label}: fit")
            try:
                status, ended = self.child(trial, "fit", [*args, *resume], run_dir)
            finally:  # also when the runner is stopped: the fit saved its step
                after = checkpoint_state(last)[0] if last.exists() else 0
                trial.set_user_attr("steps", [before, after])
            if status != 0 and not (ended and status in STOPPED_STATUSES):
                raise RunFailed(f"{label}: fit failed (exit {status}); see {run_dir / 'fit.log'}")
            if status != 0 and not 0 < self.max_steps <= after:
                raise Stopped(f"{label}: stopped by the time budget at step {after}; the same command continues")
        best, val_score, best_step, steps, task = best_checkpoint(run_dir)
        logger = json.dumps({"class_path": "lightning.pytorch.loggers.CSVLogger",
                             "init_args": {"save_dir": str(run_dir), "name": "test", "version": best.stem}})
        self.log(f"{label}: test {best.name}")
        status, _ = self.child(trial, "test", [*args, "--trainer.logger", logger, "--ckpt_path", str(best)], run_dir)
        if status != 0:
            raise RunFailed(f"{label}: test failed (exit {status}); see {run_dir / 'test.log'}")
        test_score = latest_logged(run_dir / "test" / best.stem, f"test/{task.metric_name}")
        if test_score is None:
            raise RunFailed(f"{run_dir / 'test' / best.stem / 'metrics.csv'}: no test/{task.metric_name} logged")
        trials = self.trials(arm, seed)  # this one (running) and the run's earlier ones
        commits = sorted({t.user_attrs.get("commit", self.commit) for t in trials})
        trial.set_user_attr("result", {
            "recipe": self.name, "attention": arm, "seed": seed, "steps": steps, "best_step": best_step,
            "task": task.name, f"val_{task.metric_name}": round(val_score, 6),
            f"test_{task.metric_name}": round(test_score, 6), "wall_s": round(sum(map(_seconds, trials)), 1),
            "device": "; ".join(sorted({t.user_attrs.get("device", self.device) for t in trials})),
            "commit": commits[0] if len(commits) == 1 else commits, "budget": " ".join(self.recipe_args),
            "finished": now()})
        return val_score

    def child(self, trial, stage: str, args: list[str], run_dir: Path) -> tuple[int, bool]:
        """:func:`.study.launch` of ``stage``, its seconds and exit status kept in the trial."""
        def record(seconds: float, status: int | None) -> None:
            trial.set_user_attr(f"{stage}_s", round(seconds, 1))
            if status is not None:
                trial.set_user_attr(f"{stage}_status", status)

        return launch(stage, args, run_dir / f"{stage}.log", self.child_env,
                      self.deadline if stage == "fit" else None, record)

    def ended(self, study, trial) -> None:
        """After each trial: a complete run's result published and said in one line."""
        self.current = None
        result = trial.user_attrs.get("result") if trial.state.name == "COMPLETE" else None
        if result is not None:
            self.publish()
            metric = metric_of(result)
            self.log(f"{self.name}/{result['attention']}-s{result['seed']}: val {metric} "
                     f"{result[f'val_{metric}']:.4f}, test {metric} {result[f'test_{metric}']:.4f} "
                     f"({result['steps']} steps, {result['wall_s'] / 60:.1f} min)")

    def stopped(self) -> None:
        """After a stop: the trial in progress is failed (the next invocation resumes the run)."""
        if self.current is not None and self.study is not None:
            fail_and_queue_again(self.study, self.current, queue_again=False)

    def publish(self) -> str:
        """Every finished run's result of the study merged into the results file; the table."""
        return publish_results(self.results, self.table, [
            t.user_attrs["result"] for t in self.study.get_trials(deepcopy=False)
            if t.state.name == "COMPLETE" and "result" in t.user_attrs])

    def progress(self) -> list[dict]:
        """Where every run of the grid stands, for the progress table (a finished run's steps and
        best from its result, an unfinished one's from its ``last.ckpt``)."""
        entries = []
        for arm, seed in self.all_points():
            trials, result, last = self.trials(arm, seed), self.result(arm, seed), self.run_dir(arm, seed) / LAST
            entry = {"run": f"{arm}-s{seed}", "steps": 0, "best": None, "latest": None, "done": result is not None,
                     "wall_s": round(sum(map(_seconds, trials)), 1),
                     "devices": sorted({t.user_attrs["device"] for t in trials if "device" in t.user_attrs})}
            if result is not None:
                entry["metric"] = metric_of(result)
                entry["steps"], entry["best"] = result["steps"], result[f"val_{entry['metric']}"]
            elif last.exists():
                entry["steps"], entry["metric"], entry["best"] = checkpoint_state(last)
            if "metric" in entry:
                entry["latest"] = latest_logged(self.run_dir(arm, seed) / "csv", f"val/{entry['metric']}")
            fit_s = sum(t.user_attrs.get("fit_s", 0.0) for t in trials)
            entry["steps_per_s"] = round(entry["steps"] / fit_s, 1) if fit_s and entry["steps"] else None
            entries.append(entry)
        return entries


def _seconds(trial) -> float:
    """The device time of a trial: its fit's and its test's seconds."""
    return trial.user_attrs.get("fit_s", 0.0) + trial.user_attrs.get("test_s", 0.0)


def backbone_overrides(backbone: Any) -> dict[str, Any]:
    """The recipe's ``model.backbone`` (a dict, namespace or dataclass) as a dict of its set keys."""
    if hasattr(backbone, "as_dict"):
        backbone = backbone.as_dict()
    elif dataclasses.is_dataclass(backbone):
        backbone = dataclasses.asdict(backbone)
    return {key: value for key, value in dict(backbone or {}).items() if value is not None}


def default_name(recipe_args: Sequence[str]) -> str:
    """``<config stems>-<hash of the recipe's training arguments>``: one name per recipe."""
    from graphormer_urpe.training.lightning_cli import training_args

    stems = [Path(a).stem for prev, a in zip(recipe_args, recipe_args[1:]) if prev == "--config"]
    digest = hashlib.sha256("\0".join(training_args(list(recipe_args))).encode()).hexdigest()[:8]
    return "+".join(stems or ["recipe"]) + f"-{digest}"


def checkpoint_state(path: Path) -> tuple[int, str, float | None]:
    """``(global_step, task metric, best validation score or None)`` of a ``last.ckpt``, read as
    plain data; ``ValueError`` naming a damaged or crafted file."""
    from graphormer_urpe.data.facts import DataFacts
    from graphormer_urpe.data.task import get_task
    from graphormer_urpe.prediction.load import recorded_best
    from graphormer_urpe.utils.torch_files import read_checkpoint

    checkpoint = read_checkpoint(path)
    try:
        steps = int(checkpoint["global_step"])
        task = get_task(DataFacts.recorded(checkpoint.get("hyper_parameters", {}), "task"))
        score = recorded_best(path.parent, task.monitor, checkpoint)[1]
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise ValueError(f"checkpoint {path} is not a run's last.ckpt ({type(error).__name__}: "
                         f"{error}); remove it to start the run over") from None
    return steps, task.metric_name, score


def latest_logged(logs: Path, name: str) -> float | None:
    """The value of ``name`` at the highest step in the CSV logs under ``logs`` (None: not logged)."""
    logged = [(int(row["step"]), float(row[name])) for metrics in logs.glob("**/metrics.csv")
              for row in csv.DictReader(metrics.read_text().splitlines()) if row.get(name)]
    return max(reversed(logged), key=lambda point: point[0])[1] if logged else None  # a step twice: its last

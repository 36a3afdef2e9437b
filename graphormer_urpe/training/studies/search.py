"""The hyperparameter search of ``graphormer-urpe-hpopt`` (docs/hpopt.md): an Optuna study over any
``graphormer-urpe fit`` key, each trial one ``fit`` in ``<runs-dir>/<study>/trial-<n>`` (the recipe,
then the trial's values as ``params.yaml``), reported to and pruned by :data:`TRIAL_CALLBACK`; its
objective is the best validation metric of its checkpoints. ``best.yaml`` and ``trials.csv`` are
written after every trial.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import signal
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graphormer_urpe.training.studies.search_space import (
    PARAMS_CONFIG, Param, check_recipe, config_text, recipe_record)
from graphormer_urpe.training.studies.study import (
    StorageFailed, connect, fail_and_queue_again, launch, one_line, recipe_args, safe_url,
    storage_error, worker)
from graphormer_urpe.utils.process import INTERRUPTED, StoppedBySignal

PROG = "graphormer-urpe-hpopt"
#: The trial's study, storage and pruner, as JSON, in the environment of a trial's ``fit``.
TRIAL_ENV = "GRAPHORMER_URPE_HPOPT_TRIAL"
BEST_CONFIG = "best.yaml"
TRIALS_TABLE = "trials.csv"
FIT_LOG = "fit.log"
#: The callback added to every trial's fit (:class:`graphormer_urpe.training.studies.search_trial.ReportToTrial`).
TRIAL_CALLBACK = "graphormer_urpe.training.studies.search_trial.ReportToTrial"
#: Written into a trial's run directory by the trial's callback when the pruner stopped it.
PRUNED_MARKER = "pruned.json"
#: Written there when the run diverged: the trial is recorded as pruned, with the reason.
DIVERGED_MARKER = "diverged.json"
#: The search stops after this many failed trials in a row (a recipe that cannot train).
MAX_FAILURES_IN_A_ROW = 3
#: How a study's recipe differs from another, in words.
RECIPE_PARTS = {"configs": "--config files' contents", "overrides": "overrides", "space": "search space"}


class TrialFailed(RuntimeError):
    """A trial's ``fit`` failed (its log says why); the study records the trial as failed."""


def make_sampler(name: str, seed: int | None, startup_trials: int, offset: int):
    import optuna

    seed = None if seed is None else seed + offset  # a resumed search does not redraw the same values
    return optuna.samplers.RandomSampler(seed=seed) if name == "random" else \
        optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup_trials)


def make_pruner(spec: dict):
    """The study's pruner from its spec (the search and each trial's callback build the same)."""
    import optuna

    return optuna.pruners.NopPruner() if spec["name"] == "none" else optuna.pruners.MedianPruner(
        n_startup_trials=spec["startup_trials"], n_warmup_steps=spec["warmup_validations"])


def trial_line(trial, monitor: str) -> str:
    """A finished trial in one line: its state, value, time and values."""
    took = f"{trial.duration.total_seconds():.0f} s" if trial.duration else "?"
    value = f"{monitor} {trial.value:.6g}" if trial.value is not None else (
        f"last reported {monitor} {list(trial.intermediate_values.values())[-1]:.6g}"
        if trial.intermediate_values else "no value")
    values = " ".join(f"{k}={v!r}" for k, v in trial.params.items())
    return f"trial {trial.number}: {trial.state.name.lower()}, {value} ({took}) {values}"


@dataclass
class Search:
    """One worker of a study: what every trial shares, the study and its database."""

    configs: list[str]
    overrides: list[str]
    space: dict[str, Param]
    study_dir: Path
    storage_url: str
    pruner: dict
    #: The task's validation metric and whether it is minimised or maximised (``mode``: min, max).
    objective: dict
    study: Any
    current: int | None = None  # the trial in progress
    failures: int = 0  # failed trials in a row

    @property
    def monitor(self) -> str:
        return self.objective["monitor"]

    def recipe_line(self) -> str:
        return shlex.join(["fit", *recipe_args(self.configs, self.overrides), "--config",
                           str(self.study_dir / BEST_CONFIG)])

    def trials(self, *states: str) -> list:
        """The study's trials (by any worker) in the ``TrialState`` s named."""
        from optuna.trial import TrialState

        return self.study.get_trials(deepcopy=False, states=tuple(TrialState[state] for state in states))

    def finished(self) -> int:
        return len(self.trials("COMPLETE", "PRUNED"))

    def best(self):
        """The best complete trial (None without one)."""
        return self.study.best_trial if self.trials("COMPLETE") else None

    def write_outputs(self) -> None:
        """``best.yaml`` (the best complete trial's values, a header saying how to train with them)
        and ``trials.csv``."""
        from graphormer_urpe.utils.files import atomic_write

        best = self.best()
        if best is not None:
            complete = len(self.trials("COMPLETE"))
            header = [f"{PROG}: study {self.study.study_name!r}, the best of {complete} complete trial(s):",
                      f"trial {best.number}, best {self.monitor} {best.value:.6g} "
                      f"({best.user_attrs.get('best_checkpoint', 'run ' + str(best.user_attrs.get('run_dir')))})",
                      "Train with it: graphormer-urpe " + self.recipe_line()]
            with atomic_write(self.study_dir / BEST_CONFIG) as handle:
                handle.write("".join(f"# {line}\n" for line in header) + config_text(best.params))
        table = self.study.trials_dataframe(attrs=("number", "value", "state", "params", "duration", "user_attrs"))
        with atomic_write(self.study_dir / TRIALS_TABLE) as handle:
            table.to_csv(handle, index=False)

    def fit(self, trial) -> float:
        """The trial's fit: its objective; ``optuna.TrialPruned`` (pruned, diverged), :class:`TrialFailed`."""
        import optuna

        from graphormer_urpe.prediction.load import best_checkpoint
        from graphormer_urpe.utils.torch_files import CheckpointError

        number = self.current = trial.number
        trial.set_user_attr("worker", worker())
        values = {key: param.suggest(trial) for key, param in self.space.items()}
        run_dir, log = self.study_dir / f"trial-{number}", self.study_dir / f"trial-{number}" / FIT_LOG
        run_dir.mkdir(parents=True, exist_ok=True)
        trial.set_user_attr("run_dir", str(run_dir))
        (params_file := run_dir / PARAMS_CONFIG).write_text(config_text(values))
        env = {**os.environ, TRIAL_ENV: json.dumps({
            "storage": self.storage_url, "study": self.study.study_name, "trial": number,
            "monitor": self.monitor, "pruner": self.pruner})}
        try:
            status, _ = launch("fit", [*recipe_args(self.configs, self.overrides), "--config", str(params_file),
                                       "--trainer.default_root_dir", str(run_dir),
                                       f"--trainer.callbacks+={TRIAL_CALLBACK}"], log, env)
        except KeyboardInterrupt:  # as the stop signals: the trial is failed and queued by run_trials
            raise StoppedBySignal(signal.SIGINT) from None
        if (run_dir / DIVERGED_MARKER).exists():
            reason = f"its {DIVERGED_MARKER} is damaged"
            with contextlib.suppress(ValueError, OSError, KeyError, TypeError):
                reason = json.loads((run_dir / DIVERGED_MARKER).read_text())["reason"]
            raise optuna.TrialPruned(f"diverged: {reason}; see {log}")
        if status != 0:
            raise TrialFailed(f"graphormer-urpe fit exited with status {status}; see {log}")
        try:
            best, score, step, _, _ = best_checkpoint(run_dir)
        except CheckpointError as exc:
            raise TrialFailed(f"no best checkpoint: {exc}") from None
        if not math.isfinite(score):
            raise optuna.TrialPruned(f"diverged: its best {self.monitor} is {score}; see {log}")
        trial.set_user_attr("best_checkpoint", str(best))
        trial.set_user_attr("best_step", step)
        if (run_dir / PRUNED_MARKER).is_file():
            raise optuna.TrialPruned(f"stopped by the pruner; best {self.monitor} {score:.6g}")
        return score

    def run_trial(self, trial) -> float:
        """:meth:`fit`, why it did not complete in its ``reason``; a failing database: ``StorageFailed``."""
        import optuna
        from optuna.exceptions import StorageInternalError

        try:
            return self.fit(trial)
        except StorageInternalError as exc:
            raise StorageFailed(storage_error(exc)) from None
        except (optuna.TrialPruned, TrialFailed) as exc:
            trial.set_user_attr("reason", str(exc))
            raise
        except Exception as exc:  # a full disk, a bug: the trial fails, the error is raised
            with contextlib.suppress(Exception):
                trial.set_user_attr("reason", f"{type(exc).__name__}: {one_line(exc)}")
            raise

    def ended(self, study, trial) -> None:
        """After each trial: its line (and why), the outputs; :data:`MAX_FAILURES_IN_A_ROW` stop it."""
        self.current = None
        print(trial_line(trial, self.monitor), flush=True)
        if "reason" in trial.user_attrs:
            print(f"trial {trial.number}: {trial.user_attrs['reason']}", flush=True)
        self.failures = self.failures + 1 if trial.state.name == "FAIL" else 0
        self.write_outputs()
        if self.failures >= MAX_FAILURES_IN_A_ROW:
            study.stop()

    def run_trials(self, n_trials: int | None, deadline: float | None) -> int:
        """``Study.optimize`` until the study holds ``n_trials`` finished trials or the monotonic
        ``deadline`` passed; a stop or a failing database is one line. Returns the exit status."""
        import optuna
        from optuna.exceptions import StorageInternalError
        from optuna.study import MaxTrialsCallback
        from optuna.trial import TrialState

        callbacks = [self.ended]
        try:
            if n_trials is not None:
                if self.finished() >= n_trials:
                    return 0
                callbacks.append(MaxTrialsCallback(n_trials, states=(TrialState.COMPLETE, TrialState.PRUNED)))
            timeout = None if deadline is None else deadline - time.monotonic()
            if timeout is not None and timeout <= 0:
                return 0
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                self.study.optimize(self.run_trial, timeout=timeout, catch=(TrialFailed,), callbacks=callbacks)
        except (StoppedBySignal, KeyboardInterrupt) as stop:
            status = getattr(stop, "code", INTERRUPTED)
            print(self.stopped(status), file=sys.stderr, flush=True)
            with contextlib.suppress(Exception):
                self.write_outputs()
            return status
        except (StorageFailed, StorageInternalError) as exc:
            during = "" if self.current is None else (
                f"; trial {self.current} is left running: the same command run again on this machine marks "
                "it failed and runs its values again")
            why = exc if isinstance(exc, StorageFailed) else storage_error(exc)
            print(f"{PROG}: error: the study database {safe_url(self.storage_url)} failed ({why}){during}",
                  file=sys.stderr, flush=True)
            return 1
        if self.failures >= MAX_FAILURES_IN_A_ROW:
            print(f"{PROG}: error: {self.failures} trials in a row failed; see their {FIT_LOG} under "
                  f"{self.study_dir}", file=sys.stderr)
            return 1
        return 0

    def stopped(self, status: int) -> str:
        """After a stop (exit ``status``): the trial in progress failed and queued again; the line."""
        from optuna.exceptions import StorageInternalError

        how = "Ctrl-C (SIGINT)" if status == INTERRUPTED else signal.Signals(status - 128).name
        resume = "run the same command again to resume"
        current = self.current
        if current is None:
            return f"{PROG}: stopped by {how} between trials; the finished trials are kept: {resume}"
        try:
            queued = fail_and_queue_again(self.study, current)
        except StorageInternalError as exc:
            return (f"{PROG}: stopped by {how} during trial {current} (its fit is stopped); the study "
                    f"database could not record it ({storage_error(exc)}): it is left running, and the same "
                    "command run again on this machine marks it failed and runs its values again")
        if not queued:
            return f"{PROG}: stopped by {how} as trial {current} ended; the finished trials are kept: {resume}"
        return (f"{PROG}: stopped by {how} during trial {current} (its fit is stopped; the trial is marked "
                f"failed and its values queued to run again): {resume}")


def open_search(name: str, url: str, option: str, study_dir: Path, configs: list[str], overrides: list[str],
                space: dict[str, Param], pruner: dict, sampler: str, seed: int | None,
                startup_trials: int) -> Search:
    """This worker of study ``name`` in database ``url`` (:func:`.study.connect`), its sampler
    seeded past the trials the study holds."""
    recipe = recipe_record(configs, overrides, space)
    study = connect(url, name, recipe, RECIPE_PARTS, lambda: check_recipe(configs, overrides, space),
                    study_dir, option, pruner=make_pruner(pruner))
    study.sampler = make_sampler(sampler, seed, startup_trials, len(study.trials))
    return Search(configs, overrides, space, study_dir, url, pruner, recipe["objective"], study)

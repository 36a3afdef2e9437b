"""The hyperparameter search of ``graphormer-urpe-hpopt``: an Optuna study over any
``graphormer-urpe fit`` key, each trial one ``fit`` in its own process and run directory.

Each trial runs in ``<runs-dir>/<study>/trial-<n>``: the recipe (``--config`` files, then the
overrides), then the trial's values as one more config file (``trial-<n>/params.yaml``,
:mod:`graphormer_urpe.training.studies.search_space`). Its objective is the best value of the
task's validation metric (``val/mae`` for regression, minimised; ``val/auroc`` /
``val/accuracy`` maximised), read from the run's checkpoints. A callback in the trial
(:data:`TRIAL_CALLBACK`, given the study and trial through :data:`TRIAL_ENV`) reports the metric
after each validation, and stops the run when the pruner says so (the trial is then *pruned*).
A run that diverges (a non-finite validation metric, or a fit stopped by non-finite losses) is
pruned too, with the reason, and has no value.

The study lives in an Optuna database (:mod:`graphormer_urpe.training.studies.search_storage`),
by default ``sqlite:///<runs-dir>/<study>/study.db``; any Optuna database URL lets workers on
several machines share one study. It records its recipe and search space: a run with another
recipe is refused. The trials run in a loop of ``Study.ask`` and ``Study.tell`` until the study
holds ``n_trials`` finished (complete or pruned) trials, counting earlier runs and other
workers, or the deadline has passed. Stopped by SIGTERM, SIGHUP or Ctrl-C, the search ends the
trial's fit, marks the trial failed with its values queued again, and says so in one line. The
best trial so far is written as ``<runs-dir>/<study>/best.yaml``, a config for
``graphormer-urpe fit --config base.yaml --config best.yaml``, after every complete trial;
``trials.csv`` beside it lists them all. A study database that fails during the search ends it
in one line naming the trial left running, which the same command run again fails and runs again.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graphormer_urpe.training.studies.search_space import (
    PARAMS_CONFIG, Param, check_recipe, config_text, one_line, recipe_record)
from graphormer_urpe.training.studies.search_storage import (
    RECIPE_ATTR, StorageFailed, check_writable, connect, fail_and_queue_again, heartbeat, retried,
    safe_url, storage_error, trial_id)
from graphormer_urpe.utils.process import INTERRUPTED, STOP_SIGNALS, console_command, tied_to_parent

PROG = "graphormer-urpe-hpopt"
#: The trial's study, storage and pruner, as JSON, in the environment of a trial's ``fit``.
TRIAL_ENV = "GRAPHORMER_URPE_HPOPT_TRIAL"
STUDY_DB = "study.db"
BEST_CONFIG = "best.yaml"
TRIALS_TABLE = "trials.csv"
FIT_LOG = "fit.log"
#: The callback added to every trial's fit (:class:`graphormer_urpe.training.studies.search_trial.ReportToTrial`).
TRIAL_CALLBACK = "graphormer_urpe.training.studies.search_trial.ReportToTrial"
#: Written into a trial's run directory by the trial's callback when the pruner stopped it.
PRUNED_MARKER = "pruned.json"
#: Written there when the run diverged (a non-finite validation metric, or a fit stopped by
#: non-finite losses): the trial is recorded as pruned, with the reason.
DIVERGED_MARKER = "diverged.json"
#: The search stops after this many failed trials in a row (a recipe that cannot train).
MAX_FAILURES_IN_A_ROW = 3


class TrialFailed(RuntimeError):
    """A trial's ``fit`` failed (its log says why); the study records the trial as failed."""


def make_sampler(name: str, seed: int | None, startup_trials: int, offset: int):
    import optuna

    seed = None if seed is None else seed + offset  # a resumed search does not redraw the same values
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup_trials)


def make_pruner(spec: dict):
    """The study's pruner from its spec (``name``: median or none, ``startup_trials``,
    ``warmup_validations``): the search and each trial's callback build the same."""
    import optuna

    if spec["name"] == "none":
        return optuna.pruners.NopPruner()
    return optuna.pruners.MedianPruner(n_startup_trials=spec["startup_trials"],
                                       n_warmup_steps=spec["warmup_validations"])


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
    storage: Any

    @property
    def monitor(self) -> str:
        return self.objective["monitor"]

    def fit_args(self, params_file: Path, run_dir: Path) -> list[str]:
        return ["fit", *[a for path in self.configs for a in ("--config", path)], *self.overrides,
                "--config", str(params_file), "--trainer.default_root_dir", str(run_dir),
                f"--trainer.callbacks+={TRIAL_CALLBACK}"]

    def recipe_line(self) -> str:
        return shlex.join(["fit", *[a for path in self.configs for a in ("--config", path)], *self.overrides,
                           "--config", str(self.study_dir / BEST_CONFIG)])

    def finished(self) -> int:
        """How many trials of the study are finished (complete or pruned), by any worker."""
        from optuna.trial import TrialState

        return len(self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)))

    def best(self):
        """The best complete trial (None without one)."""
        from optuna.trial import TrialState

        return self.study.best_trial if self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) else None

    def best_config(self) -> str | None:
        """``best.yaml``'s text: the best complete trial's values, with a header saying where
        they come from and how to train with them; None without a complete trial."""
        from optuna.trial import TrialState

        complete = self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if not complete:
            return None
        best = self.study.best_trial
        monitor = self.study.user_attrs[RECIPE_ATTR]["objective"]["monitor"]
        header = [f"{PROG}: study {self.study.study_name!r}, the best of {len(complete)} complete trial(s):",
                  f"trial {best.number}, best {monitor} {best.value:.6g} "
                  f"({best.user_attrs.get('best_checkpoint', 'run ' + str(best.user_attrs.get('run_dir')))})",
                  "Train with it: graphormer-urpe " + self.recipe_line()]
        return "".join(f"# {line}\n" for line in header) + config_text(best.params)

    def write_outputs(self) -> None:
        """``best.yaml`` (once a trial is complete) and ``trials.csv``, each written whole."""
        from graphormer_urpe.utils.files import atomic_write

        text = self.best_config()
        if text is not None:
            with atomic_write(self.study_dir / BEST_CONFIG) as handle:
                handle.write(text)
        table = self.study.trials_dataframe(attrs=("number", "value", "state", "params", "duration", "user_attrs"))
        with atomic_write(self.study_dir / TRIALS_TABLE) as handle:
            table.to_csv(handle, index=False)

    def fit(self, trial) -> float:
        """Trial ``trial``'s fit, run to its end: its objective; ``optuna.TrialPruned`` when the
        pruner stopped it or it diverged (a non-finite validation metric, or every step of a
        logging interval non-finite), :class:`TrialFailed` when its fit failed otherwise."""
        import optuna

        from graphormer_urpe.prediction.load import best_checkpoint
        from graphormer_urpe.utils.files import read_json
        from graphormer_urpe.utils.torch_files import CheckpointError

        number = trial.number
        retried(f"trial {number}: recording its worker", trial.set_user_attr, "worker",
                f"{socket.gethostname()}:{os.getpid()}")
        values = {key: retried(f"trial {number}: drawing {key}", param.suggest, trial)
                  for key, param in self.space.items()}
        run_dir = self.study_dir / f"trial-{number}"
        run_dir.mkdir(parents=True, exist_ok=True)
        retried(f"trial {number}: recording its run directory", trial.set_user_attr, "run_dir", str(run_dir))
        params_file = run_dir / PARAMS_CONFIG
        params_file.write_text(config_text(values))
        env = {**os.environ, TRIAL_ENV: json.dumps({
            "storage": self.storage_url, "study": self.study.study_name, "trial": number,
            "monitor": self.monitor, "pruner": self.pruner})}
        log = run_dir / FIT_LOG
        command = [*console_command("graphormer-urpe", "graphormer_urpe.cli.fit"),
                   *self.fit_args(params_file, run_dir)]
        with open(log, "w") as out:
            out.write(shlex.join(command) + "\n")
            out.flush()
            done = subprocess.run(command, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                  preexec_fn=tied_to_parent(signal.SIGTERM))
        try:
            diverged = read_json(run_dir / DIVERGED_MARKER, None)
        except ValueError:
            diverged = {"reason": f"its {DIVERGED_MARKER} is damaged"}
        if diverged is not None:
            raise optuna.TrialPruned(f"diverged: {diverged.get('reason')}; see {log}")
        if done.returncode != 0:
            raise TrialFailed(f"graphormer-urpe fit exited with status {done.returncode}; see {log}")
        try:
            best, score, step, _, _ = best_checkpoint(run_dir)
        except CheckpointError as exc:
            raise TrialFailed(f"no best checkpoint: {exc}") from None
        if not math.isfinite(score):
            raise optuna.TrialPruned(f"diverged: its best {self.monitor} is {score}; see {log}")
        retried(f"trial {number}: recording its checkpoint", trial.set_user_attr, "best_checkpoint", str(best))
        retried(f"trial {number}: recording its checkpoint", trial.set_user_attr, "best_step", step)
        if (run_dir / PRUNED_MARKER).is_file():
            raise optuna.TrialPruned(f"stopped by the pruner; best {self.monitor} {score:.6g}")
        return score

    def run_trial(self, trial) -> tuple[Any, float | None, str | None]:
        """Trial ``trial`` run with its heartbeat: ``(its state, its value, why it failed or was
        pruned)``, the reason recorded in the trial (user attribute ``reason``). Any other error
        fails the trial before it is raised."""
        import optuna
        from optuna.trial import TrialState

        value, reason = None, None
        with heartbeat(self.storage, trial_id(self.storage, self.study.study_name, trial.number)):
            try:
                value, state = self.fit(trial), TrialState.COMPLETE
            except optuna.TrialPruned as exc:
                state, reason = TrialState.PRUNED, str(exc)
            except TrialFailed as exc:
                state, reason = TrialState.FAIL, str(exc)
            except StorageFailed:  # the database cannot record the failure either
                raise
            except Exception as exc:  # noqa: BLE001 - a full disk, a bug: the trial fails, the error is raised
                with contextlib.suppress(Exception):
                    trial.set_user_attr("reason", f"{type(exc).__name__}: {one_line(exc)}")
                    self.study.tell(trial, state=TrialState.FAIL)
                raise
        if reason is not None:
            retried(f"trial {trial.number}: recording why it ended", trial.set_user_attr, "reason", reason)
        return state, value, reason

    def run_trials(self, n_trials: int | None, deadline: float | None) -> int:
        """Trials one after another until the study holds ``n_trials`` finished ones, the
        ``time.monotonic()`` deadline has passed, or :data:`MAX_FAILURES_IN_A_ROW` failed in a
        row; after each, its line and the outputs. A signal, Ctrl-C or a study database that
        fails ends the search in one line naming the trial in progress. Returns the exit status."""
        import optuna
        from optuna.exceptions import StorageInternalError
        from optuna.trial import TrialState

        failures, current = 0, None
        try:
            while failures < MAX_FAILURES_IN_A_ROW:
                if n_trials is not None and retried("counting the finished trials", self.finished) >= n_trials:
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    break
                with warnings.catch_warnings():  # heartbeats are "experimental", and meant for optimize()
                    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                    warnings.filterwarnings("ignore", "Heartbeat of storage")  # heartbeat() beats for this loop
                    retried("failing trials whose worker stopped beating", optuna.storages.fail_stale_trials,
                            self.study)
                    trial = retried("starting a trial", self.study.ask)
                current = trial.number
                state, value, reason = self.run_trial(trial)
                frozen = retried(f"trial {current}: recording its result ({state.name.lower()}"
                                 f"{'' if value is None else f', {self.monitor} {value:.6g}'})",
                                 self.study.tell, trial, value, state, skip_if_finished=True)
                current = None
                print(trial_line(frozen, self.monitor), flush=True)
                if reason is not None:
                    print(f"trial {frozen.number}: {reason}", flush=True)
                failures = failures + 1 if frozen.state == TrialState.FAIL else 0
                retried("writing best.yaml and trials.csv", self.write_outputs)
        except (SystemExit, KeyboardInterrupt) as stop:
            if isinstance(stop, SystemExit) and not (isinstance(stop.code, int) and stop.code - 128 in STOP_SIGNALS):
                raise
            line, status = self.stopped(stop, current)
            print(line, file=sys.stderr, flush=True)
            with contextlib.suppress(Exception):
                self.write_outputs()
            return status
        except (StorageFailed, StorageInternalError) as exc:
            during = "" if current is None else (
                f"; trial {current} is left running: the same command run again on this machine marks it "
                "failed and runs its values again")
            print(f"{PROG}: error: the study database {safe_url(self.storage_url)} failed "
                  f"({storage_error(exc)}){during}", file=sys.stderr, flush=True)
            return 1
        if failures >= MAX_FAILURES_IN_A_ROW:
            print(f"{PROG}: error: {failures} trials in a row failed; see their {FIT_LOG} under {self.study_dir}",
                  file=sys.stderr)
            return 1
        return 0

    def stopped(self, stop: BaseException, current: int | None) -> tuple[str, int]:
        """After SIGTERM, SIGHUP or Ctrl-C: the trial in progress (its fit already ended) is
        marked failed and its values queued to run again; the line that says so, and the exit
        status."""
        from optuna.exceptions import StorageInternalError

        if isinstance(stop, KeyboardInterrupt):
            how, status = "Ctrl-C (SIGINT)", INTERRUPTED
        else:
            status = stop.code
            how = signal.Signals(status - 128).name
        resume = "run the same command again to resume"
        if current is None:
            return f"{PROG}: stopped by {how} between trials; the finished trials are kept: {resume}", status
        try:
            queued = retried(f"trial {current}: marking it failed", fail_and_queue_again, self.study, current)
        except (StorageFailed, StorageInternalError) as exc:
            return (f"{PROG}: stopped by {how} during trial {current} (its fit is stopped); the study "
                    f"database could not record it ({storage_error(exc)}): it is left running, and the same "
                    "command run again on this machine marks it failed and runs its values again", status)
        if not queued:
            return f"{PROG}: stopped by {how} as trial {current} ended; the finished trials are kept: {resume}", status
        return (f"{PROG}: stopped by {how} during trial {current} (its fit is stopped; the trial is marked "
                f"failed and its values queued to run again): {resume}", status)


def open_search(name: str, url: str, option: str, study_dir: Path, configs: list[str], overrides: list[str],
                space: dict[str, Param], pruner: dict, sampler: str, seed: int | None,
                startup_trials: int) -> Search:
    """This worker of study ``name`` in the database ``url`` (``option`` names it in a refusal):
    the study folder and database checked writable, the study created with the recipe (after
    the recipe's check) or loaded and compared with it, its sampler seeded past the trials it
    holds. :class:`~graphormer_urpe.training.studies.search_space.Refused` for bad input."""
    import optuna

    check_writable(study_dir, url, option)
    recipe = recipe_record(configs, overrides, space)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage, study = connect(url, name, recipe, lambda: check_recipe(configs, overrides, space),
                             make_pruner(pruner), study_dir, option)
    study.sampler = make_sampler(sampler, seed, startup_trials, len(study.trials))
    return Search(configs, overrides, space, study_dir, url, pruner, recipe["objective"], study, storage)

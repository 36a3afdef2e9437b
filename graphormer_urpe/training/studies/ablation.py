"""The seeded URPE-vs-RPE ablation on one recipe (``graphormer-urpe-ablation``), resumable.

A :class:`Grid` of arms (:data:`~graphormer_urpe.training.studies.ablation_run.ARMS`: ``urpe``, B
and C; ``rpe``, plain Graphormer, B only; ``urpe-shared``, one C for all layers) x seeds is
trained with the training CLI, one ``fit`` subprocess per run
(:class:`~graphormer_urpe.training.studies.ablation_run.Run`), on the same recipe (config files
plus LightningCLI overrides). Every run:

* lives in ``<runs-dir>/<name>/<arm>-s<seed>/`` with its logs, checkpoints and ``ablation_run.json``
  (its arguments, commit, attempts and result);
* takes ``seed`` both as ``seed_everything`` (initialisation, dropout) and as the training-order
  seed of the DataModule;
* resumes from its ``checkpoints/last.ckpt`` when the grid was killed (its steps are the
  checkpoint's ``global_step``), starts over when it has none, and is not redone once it has a
  result;
* is trained by one runner at a time: the runner holds :data:`LOCK_FILE` in every run directory
  of its grid (:meth:`Grid.lock`), and a second runner given any of them is refused, naming the
  first one's pid;
* is selected on the validation metric of its task only (the CLI's best checkpoint: ``val/mae``
  for regression, see :mod:`graphormer_urpe.data.task`) and that checkpoint is evaluated on
  the test split (``graphormer-urpe test``).

Results are merged into a JSON list (one entry per ``(recipe, attention, seed)``, a rerun
replaces its entry) and summarised in a markdown table
(:mod:`~graphormer_urpe.training.studies.ablation_results`).

With a time budget (:meth:`Grid.run_slices`) the grid trains in time slices instead of each run
to its end: the runs of the first seed with unfinished runs advance one slice at a time (by
default the budget shared by that seed's arms), the run with the fewest steps first, so the arms
of a seed stay within one slice of each other; the next seed starts when the previous one is
done. A slice ends with SIGTERM to its ``fit``, which saves the run's whole state (weights,
AdamW, schedule, RNG, data position) in ``last.ckpt`` at the end of the step in progress; the
same command, here or on another machine, continues exactly where it stopped. A finished run is
tested at once.

While the grid runs (the command holds it in
:func:`~graphormer_urpe.utils.process.stop_on_signals`), SIGTERM and SIGHUP stop it as Ctrl-C
does: the fit in progress saves and stops, and
:class:`~graphormer_urpe.utils.process.StoppedBySignal` is raised where the runner waits.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any, Sequence

from graphormer_urpe.training.studies.ablation_results import (
    code_commit, describe_device, metric_of, now, publish_results)
from graphormer_urpe.training.studies.ablation_run import ARMS, RUN_RECORD, Run, checkpoint_state
from graphormer_urpe.utils.files import hold_directory

#: The name of a run directory: ``<arm>-s<seed>``.
RUN_DIR = re.compile(rf"(?P<arm>{'|'.join(map(re.escape, ARMS))})-s(?P<seed>0|[1-9][0-9]*)")
#: In a run directory: held (a ``filelock`` lock) by the runner that trains it, and names its pid.
LOCK_FILE = "ablation.lock"
#: The lock files this process holds (:meth:`Grid.lock`), which a forked child lets go of.
_HELD_LOCKS: list[IO] = []
#: A slice shorter than this is not started (a ``fit`` needs seconds to start before it trains).
MIN_SLICE_S = 20.0


class RunsFailed(RuntimeError):
    """Some runs of the grid failed (each named); the others went on."""


class Grid:
    """The runs ``arms x seeds`` of one recipe (``configs``, each a packaged recipe's name or a
    config file, then LightningCLI ``overrides``) in ``runs_dir/<name>/``; ``name`` defaults to
    :func:`default_name`. Finished runs' results are merged into ``results`` and its markdown
    ``table`` (default: ``results`` with ``.md``). ``jobs`` runs at a time, each with
    ``threads_per_job`` OMP/MKL threads (default: torch's choice); with ``time_budget`` (seconds),
    slices of at most ``slice_s`` seconds instead (:meth:`run_slices`)."""

    def __init__(self, configs: Sequence[str], overrides: Sequence[str], *, runs_dir: Path,
                 results: Path, arms: Sequence[str], seeds: Sequence[int], name: str | None = None,
                 table: Path | None = None, jobs: int = 1, threads_per_job: int | None = None,
                 time_budget: float | None = None, slice_s: float | None = None) -> None:
        self.recipe_args = [a for config in configs for a in ("--config", config)] + list(overrides)
        self.name = name or default_name(self.recipe_args)
        self.dir = runs_dir / self.name
        self.results, self.table = results, table or results.with_suffix(".md")
        self.runs = [Run(self, arm, seed) for seed in seeds for arm in arms]
        self.jobs = jobs
        self.time_budget, self.slice = time_budget, slice_s
        self.started = time.monotonic()  # the time budget counts from here
        self.threads_per_job = threads_per_job
        self.commit = code_commit()
        self.device = describe_device(jobs, threads_per_job)
        self.budget = " ".join(self.recipe_args)
        self.child_env = dict(os.environ)
        if threads_per_job:
            for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
                self.child_env[var] = str(threads_per_job)
        self.recipe_backbone: dict[str, Any] = {}  # set by resolve_recipe()
        self.max_steps = -1  # the recipe's trainer.max_steps, set by resolve_recipe()
        self._results_lock, self._log_lock = threading.Lock(), threading.Lock()

    def log(self, message: str) -> None:
        with self._log_lock:  # one line per message from the parallel runs
            print(f"[{now()}] {message}", flush=True)

    def resolve_recipe(self, prepare_data: bool) -> None:
        """Read the recipe once (:func:`~graphormer_urpe.training.studies.search_space.parse_fit`,
        the search's reader): its ``model.backbone`` (the arms are merged into it) and its step
        budget; a run directory started with other arguments is refused then, before any work;
        when runs remain, the data is built here before parallel runs would race to build it."""
        from lightning.pytorch.cli import instantiate_class

        from graphormer_urpe.training.studies.search_space import parse_fit

        config = parse_fit([*self.recipe_args, "--trainer.logger", "false",
                            "--trainer.default_root_dir", str(self.dir)])
        self.recipe_backbone = backbone_overrides(config.model.backbone)
        self.max_steps = config.trainer.max_steps
        if self.time_budget and self.max_steps < 1:
            raise ValueError("--time-budget needs a step budget (trainer.max_steps) to tell when a run is done")
        for run in self.all_runs():  # the grid's runs on disk are of one recipe
            run.load_record()
        if prepare_data:
            instantiate_class((), config.data).prepare_data()

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
        """Train and test every run of this invocation not finished yet (``jobs`` at a time, or in
        slices of the time budget), each run's result published as it finishes; the results.
        :class:`RunsFailed` names the runs that failed, after the others."""
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
            raise RunsFailed(f"{len(errors)} of {len(self.runs)} runs failed:\n"
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
        """The time budget: slices of at most ``slice_s`` seconds (default: the budget shared by
        the arms) until the budget, counted from the runner's start, is spent or every run is
        finished (see the module's docstring). A run that fails is reported and left for this
        invocation; the others go on (:class:`RunsFailed` names them at the end)."""
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
            raise RunsFailed(f"{len(failed)} of {len(self.runs)} runs failed:\n"
                             + "\n".join(str(e) for e in failed.values()))
        return [r["result"] for r in (run.read_record() or {} for run in self.runs) if "result" in r]

    def progress(self) -> list[dict]:
        """:meth:`Run.progress` of every run of the grid on disk (:meth:`all_runs`)."""
        return [run.progress() for run in self.all_runs()]


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


def _in_a_forked_child() -> None:
    """A process forked by the runner (a worker that builds the data) lets go of its copies of
    the run directories' locks: a worker that outlived the runner would hold them. A fit is a
    new program (``exec``) and inherits no lock."""
    if _HELD_LOCKS:
        null = os.open(os.devnull, os.O_RDONLY)
        for handle in _HELD_LOCKS:  # the open file stays valid; the lock is the runner's alone
            os.dup2(null, handle.fileno())
        os.close(null)


os.register_at_fork(after_in_child=_in_a_forked_child)

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

    graphormer-urpe-ablation --config configs/zinc.yaml --name zinc-400k \\
        --seeds 0 1 2 --jobs 1 --figures docs/figures   # the paper's 400k steps (one GPU)
    graphormer-urpe-ablation --config configs/zinc.yaml --config configs/zinc_v2.yaml \\
        --name cpu-slim-1256 --jobs 2 --threads-per-job 1 --trainer.precision 32-true --trainer.max_steps 1256 \\
        --model.warmup_steps 126 --model.total_steps 1256   # a CPU budget: 8 epochs
    graphormer-urpe-ablation --table-only     # rewrite the table from the JSON
    graphormer-urpe-ablation --config configs/zinc.yaml --ensemble --name zinc-paper \\
        --results docs/results/zinc_gpu.json --readme README.md --figures docs/figures
        # all six runs side by side in one process (one GPU), then tested as above

``--ensemble`` trains the runs not yet trained in this process as one stacked model
(:mod:`graphormer_urpe.training.ensemble`: each member with its solo run's initialisation, data
order, clipping, optimizer state and checkpoints), resumable from ``<runs-dir>/<name>/ensemble/``;
testing and results then go as for solo runs. ``--readme`` writes the recipe's table into a
markdown file between ``<!-- ablation:NAME -->`` and ``<!-- /ablation:NAME -->``.

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
    readme_block, write_readme_block, write_table)
from graphormer_urpe.files import hold_directory, read_json, write_json

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


class Run:
    """One ``(arm, seed)`` of the grid and its run directory."""

    def __init__(self, grid: "Grid", arm: str, seed: int) -> None:
        self.grid, self.arm, self.seed = grid, arm, seed
        self.dir = grid.dir / f"{arm}-s{seed}"
        self.record_path = self.dir / RUN_RECORD

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
            raise ValueError(f"{self.dir} was started with other arguments:\n  {record['cli_args']}"
                             f"\nnow:\n  {self.cli_args}\nchoose another --name or remove it")
        return record

    def _subprocess(self, stage: str, args: list[str], record: dict) -> None:
        """``graphormer-urpe <stage> args`` with its output appended to ``<stage>.log``; the
        attempt's wall time is kept up to date in the run record (a kill loses < HEARTBEAT_S)."""
        command = [sys.executable, "-m", "graphormer_urpe.training.cli", stage, *args]
        attempt = {"stage": stage, "started": now(), "commit": self.grid.commit, "wall_s": 0.0,
                   "returncode": None}
        record["attempts"].append(attempt)
        write_json(self.record_path, record)
        start = time.perf_counter()
        with open(self.dir / f"{stage}.log", "a") as log:
            log.write(f"\n# {now()} {' '.join(command)}\n")
            log.flush()
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                       env=self.grid.child_env, preexec_fn=_die_with_parent)
            while True:
                try:
                    returncode = process.wait(timeout=HEARTBEAT_S)
                    break
                except subprocess.TimeoutExpired:
                    attempt["wall_s"] = round(time.perf_counter() - start, 1)
                    write_json(self.record_path, record)
        attempt.update(wall_s=round(time.perf_counter() - start, 1), returncode=returncode)
        write_json(self.record_path, record)
        if returncode != 0:
            raise RuntimeError(f"{self.label}: {stage} failed (exit {returncode}); see "
                               f"{self.dir / (stage + '.log')}")

    def execute(self) -> dict:
        """Fit (or resume), test, and return the result entry; a finished run returns its
        stored result without running anything."""
        self.dir.mkdir(parents=True, exist_ok=True)
        record = self.load_record()
        if "result" in record:
            return record["result"]
        last = self.dir / "checkpoints" / "last.ckpt"
        if not record.get("fit_done"):
            if last.exists():
                resume = ["--ckpt_path", str(last)]
                self.grid.log(f"{self.label}: fit (resuming from last.ckpt at step {checkpoint_step(last)})")
            else:  # no resumable state: checkpoints of a run killed before its first last.ckpt go
                resume = ["--checkpoint.overwrite", "true"]
                self.grid.log(f"{self.label}: fit")
            self._subprocess("fit", [*self.cli_args, *resume], record)
            record["fit_done"] = True
            write_json(self.record_path, record)
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
        record["result"] = {
            "recipe": self.grid.name, "attention": self.arm, "seed": self.seed, "steps": steps,
            "best_step": best_step, "task": task.name, f"val_{task.metric_name}": round(val_score, 6),
            f"test_{task.metric_name}": round(test_score, 6),
            "wall_s": round(sum(a["wall_s"] for a in record["attempts"]), 1),
            "device": self.grid.device, "commit": commits[0] if len(commits) == 1 else commits,
            "budget": self.grid.budget, "finished": now(),
        }
        write_json(self.record_path, record)
        return record["result"]


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
        self.ensemble = args.ensemble
        self.cuda_graph, self.in_turn, self.attention_impl = args.cuda_graph, args.in_turn, args.attention_impl
        self.threads_per_job = args.threads_per_job
        self.commit = code_commit()
        self.device = describe_device(args.jobs, args.threads_per_job,
                                      len(self.runs) if args.ensemble else 0)
        self.budget = " ".join(self.recipe_args)
        self.child_env = dict(os.environ)
        if args.threads_per_job:
            for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
                self.child_env[var] = str(args.threads_per_job)
        self.recipe_backbone: dict[str, Any] = {}  # set by resolve_recipe()
        self._results_lock, self._log_lock = threading.Lock(), threading.Lock()

    def log(self, message: str) -> None:
        with self._log_lock:  # one line per message from the parallel runs
            print(f"[{now()}] {message}", flush=True)

    def resolve_recipe(self, prepare_data: bool) -> None:
        """Parse the recipe once: its ``model.backbone`` (the arms are merged into it) and, when
        runs remain, its data built here before parallel runs would race to build it."""
        from graphormer_urpe.training.cli import build_cli

        sys.argv = sys.argv[:1]  # the recipe travels as `args`; LightningCLI must not read ours
        cli = build_cli([*self.recipe_args, "--trainer.logger", "false",
                         "--trainer.default_root_dir", str(self.dir)], run=False)
        self.recipe_backbone = backbone_overrides(cli.config.model.backbone)
        if prepare_data:
            cli.datamodule.prepare_data()

    def _finish(self, run: Run) -> dict:
        result = run.execute()
        with self._results_lock:
            merge_results(self.results, [result])
            write_table(self.results, self.table)
        metric = metric_of(result)
        self.log(f"{run.label}: val {metric} {result[f'val_{metric}']:.4f}, test {metric} "
                 f"{result[f'test_{metric}']:.4f}"
                 f" ({result['steps']} steps, {result['wall_s'] / 60:.1f} min)")
        return result

    def lock(self) -> None:
        """Hold every run directory of this grid (and the ensemble's) until the process ends
        (:func:`~graphormer_urpe.files.hold_directory` on :data:`LOCK_FILE`); ``ValueError`` when
        another runner holds one."""
        dirs = [run.dir for run in self.runs] + ([self.dir / "ensemble"] if self.ensemble else [])
        self._locks = [hold_directory(directory, LOCK_FILE, "graphormer-urpe-ablation",
                                      "wait for it to end, or choose another --name or --runs-dir")
                       for directory in dirs]

    def release(self) -> None:
        """Let go of the run directories :meth:`lock` holds (a process that goes on after
        :func:`main`, such as a test, must not keep them)."""
        for handle in getattr(self, "_locks", ()):
            handle.close()
        self._locks = []

    def check_checkpoints(self) -> None:
        """Read (as plain data, :func:`checkpoint_step`) the ``last.ckpt`` of every unfinished
        run, which it resumes or tests from: a damaged or crafted one is refused (``ValueError``
        naming it) before any run starts."""
        for run in self.runs:
            last = run.dir / "checkpoints" / "last.ckpt"
            if last.exists() and "result" not in read_json(run.record_path, {}):
                checkpoint_step(last)

    def run(self) -> list[dict]:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log(f"grid {self.name}: {len(self.runs)} runs, {self.jobs} at a time, "
                 f"commit {self.commit}")
        self.resolve_recipe(any("result" not in read_json(r.record_path, {}) for r in self.runs))
        if self.ensemble:
            self.fit_ensemble()
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

    def fit_ensemble(self) -> None:
        """``--ensemble``: the runs not yet fitted are trained side by side in this process as
        one stacked model (:class:`~graphormer_urpe.training.ensemble.Ensemble`, state in
        ``<runs-dir>/<name>/ensemble/``, resumed from there), each into its own run directory
        with the checkpoints its solo ``fit`` would write; testing then goes on as for solo runs.
        Every member's record counts the ensemble's whole wall time."""
        import torch

        from graphormer_urpe.training.ensemble import Ensemble, EnsembleStopped, MemberSpec, step_way
        from graphormer_urpe.training.run_checkpoint import hold_run_dir

        pending = [(run, run.load_record()) for run in self.runs]
        pending = [(run, record) for run, record in pending
                   if "result" not in record and not record.get("fit_done")]
        if not pending:
            return
        if self.threads_per_job:
            torch.set_num_threads(self.threads_per_job)
        attempts = []
        for run, record in pending:
            run.dir.mkdir(parents=True, exist_ok=True)
            attempts.append({"stage": "fit-ensemble", "started": now(), "commit": self.commit,
                             "wall_s": 0.0, "returncode": None,
                             "members": [r.label for r, _ in pending]})
            record["attempts"].append(attempts[-1])
            write_json(run.record_path, record)
        start = time.perf_counter()

        def record_attempts(returncode: int | None = None, fit_done: bool = False) -> None:
            """Every member's record: the attempt's wall time so far, and how it ended."""
            for (run, record), attempt in zip(pending, attempts):
                attempt["wall_s"] = round(time.perf_counter() - start, 1)
                if returncode is not None:
                    attempt["returncode"] = returncode
                if fit_done:
                    record["fit_done"] = True
                write_json(run.record_path, record)

        def progress(message: str) -> None:
            self.log(message)
            record_attempts()

        how = step_way(self.in_turn, self.attention_impl)
        self.log(f"{self.name}: fit {len(pending)} runs as one ensemble{f' ({how})' if how else ''}: "
                 + ", ".join(run.label for run, _ in pending))
        try:
            for run, _ in pending:  # each member's run directory, as its solo fit would hold it
                hold_run_dir(run.dir)
            ensemble = Ensemble([MemberSpec(run.label, tuple(run.cli_args)) for run, _ in pending],
                                self.dir / "ensemble", progress=progress, cuda_graph=self.cuda_graph,
                                in_turn=self.in_turn, attention_impl=self.attention_impl)
            ensemble.fit()
        except EnsembleStopped as stopped:  # SIGINT / SIGTERM: resumable from the saved state
            # "finished": the budget was trained; only the tests are left
            record_attempts(128 + stopped.signum, fit_done=stopped.how == "finished")
            print(f"graphormer-urpe-ablation: {stopped}", file=sys.stderr, flush=True)
            raise SystemExit(128 + stopped.signum) from None
        except (ValueError, FloatingPointError) as error:  # a recipe it cannot train, a diverged
            # member, a saved state of other runs, a run directory in use: one line that says
            # which, no traceback
            raise SystemExit(f"graphormer-urpe-ablation: error: {error}") from None
        record_attempts(0, fit_done=True)


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
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time")
    parser.add_argument("--threads-per-job", type=int, default=None,
                        help="OMP/MKL threads of each run (CPU); default: torch's choice")
    parser.add_argument("--table-only", action="store_true",
                        help="only rewrite the table from the results file")
    parser.add_argument("--ensemble", action="store_true",
                        help="train the grid's runs side by side in this process as one stacked "
                             "model (arms urpe and rpe; docs/ablation.md), then test each")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="with --ensemble on a GPU: capture the whole training step in one CUDA "
                             "graph and replay it")
    parser.add_argument("--in-turn", action="store_true",
                        help="with --ensemble: each step runs the members' forward and backward one "
                             "after another instead of all at once (for a GPU one member keeps busy)")
    # training/ensemble.py's ENSEMBLE_ATTENTION_IMPLS, spelled out so that --help imports no torch
    parser.add_argument("--attention-impl", choices=("eager", "triton"), default="eager",
                        help="with --ensemble --in-turn: the members' attention core (triton: the "
                             "fused kernels; how the steps run, not what is trained)")
    parser.add_argument("--readme", type=Path, default=None, metavar="FILE",
                        help="also write this recipe's table into FILE between the lines "
                             "<!-- ablation:NAME --> and <!-- /ablation:NAME -->")
    parser.add_argument("--figures", type=Path, default=None, metavar="DIR",
                        help="after the grid, plot B and C of the best-validation URPE run and "
                             "B of RPE with the same seed to DIR/<name>-tables.png")
    args, overrides = parser.parse_known_args(argv)
    args.config = args.config or ["configs/zinc.yaml"]
    if args.jobs < 1:
        parser.error("--jobs must be >= 1")
    if args.readme and args.table_only and not args.name:
        parser.error("--readme with --table-only needs --name")
    if (args.cuda_graph or args.in_turn) and not args.ensemble:
        parser.error("--cuda-graph and --in-turn change the --ensemble step: add --ensemble")
    if args.attention_impl != "eager" and not (args.ensemble and args.in_turn):
        parser.error(f"--attention-impl {args.attention_impl} runs the members of --ensemble --in-turn "
                     "(vmap cannot batch the fused kernels); a solo run takes "
                     f"--model.backbone.attention_impl {args.attention_impl}")
    if args.ensemble and not set(args.arms) <= {"urpe", "rpe"}:
        parser.error(f"--ensemble trains the arms urpe and rpe, not {sorted(set(args.arms) - {'urpe', 'rpe'})}")
    stray = [a for a in overrides if a.startswith("--") and not a.startswith(
        ("--trainer.", "--model.", "--data.", "--checkpoint.", "--lr_monitor."))]
    if stray:
        parser.error(f"unknown arguments {stray}: only LightningCLI overrides (--trainer.*, "
                     "--model.*, --data.*, --checkpoint.*) are passed through")
    return args, overrides


def main(argv: Sequence[str] | None = None) -> None:
    """The command (returns None: a console script exits with main()'s value)."""
    args, overrides = parse_args(argv)
    start = time.perf_counter()
    try:
        read_results(args.results)  # a damaged file is reported now, not after the runs
    except ValueError as error:
        print(f"graphormer-urpe-ablation: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    with contextlib.ExitStack() as held:  # the run directories are let go when main() ends
        if args.table_only:
            results = read_json(args.results, [])
            print(write_table(args.results, args.table or args.results.with_suffix(".md")))
        else:
            grid = Grid(args, overrides)
            if args.readme:  # a missing block is said now, not after training
                try:
                    readme_block(args.readme, grid.name)
                except ValueError as error:
                    raise SystemExit(f"graphormer-urpe-ablation: error: {error}") from None
            held.callback(grid.release)
            try:
                grid.lock()
                grid.check_checkpoints()
            except ValueError as error:
                print(f"graphormer-urpe-ablation: error: {error}", file=sys.stderr)
                raise SystemExit(2) from None
            results = grid.run()
            print(write_table(grid.results, grid.table))
        if args.readme:
            write_readme_block(args.readme, args.name or grid.name, read_json(args.results, []))
        if args.figures:
            chosen = [e for e in results if args.name in (None, e.get("recipe"))]
            from graphormer_urpe.plot import plot_learned_tables  # matplotlib only when plotting

            print(plot_learned_tables(chosen, args.runs_dir, args.figures))
    if not args.table_only:
        print(f"graphormer-urpe-ablation: {grid.name} took {(time.perf_counter() - start) / 60:.1f} "
              f"min ({len(results)} runs)")


if __name__ == "__main__":
    main()

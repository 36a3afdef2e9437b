"""``graphormer-urpe-ablation``: the seeded URPE-vs-RPE ablation on one recipe, resumable.

A grid of arms x seeds (:mod:`graphormer_urpe.training.studies.ablation`), each run a
``graphormer-urpe fit`` then ``test`` in ``<runs-dir>/<name>/<arm>-s<seed>/``; the results merged
into a JSON list and its markdown table, ``--readme`` blocks and ``--figures`` written after every
invocation (docs/ablation.md: the command, resuming, ``--time-budget``, several jobs).

    graphormer-urpe-ablation --config zinc --name zinc-paper --time-budget 8m \\
        --runs-dir results/runs --results docs/results/zinc_gpu.json --readme README.md
    graphormer-urpe-ablation --table-only     # rewrite the table from the JSON

Every file it reads and writes is checked before any work: one line and exit status 2 otherwise.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from graphormer_urpe.cli.arguments import duration, folder_name_problem, refuse_overwriting_inputs
from graphormer_urpe.training.recipes import resolve_config
from graphormer_urpe.training.studies.ablation import ARMS, MAX_SEED, Grid, RunsFailed
from graphormer_urpe.training.studies.ablation_results import (
    RESULTS_FILE, best_run, figure_path, read_results, readme_markers, write_progress_block,
    write_readme_block, write_table)
from graphormer_urpe.training.studies.study import STUDY_DB, page_block, storage_error
from graphormer_urpe.utils.extras import missing_extra
from graphormer_urpe.utils.files import (
    check_creatable_dir, check_writable_dir, written_in_place)
from graphormer_urpe.utils.process import StoppedBySignal, stop_on_signals


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
                        help="recipe name, a plain name: its run directory in --runs-dir and the "
                             "results' 'recipe' field (default: config stems + a hash of the recipe "
                             "arguments)")
    parser.add_argument("--runs-dir", type=Path, default=Path("runs/ablation"))
    parser.add_argument("--results", type=Path, default=None,
                        help=f"JSON list of runs, merged into (None: <runs-dir>/{RESULTS_FILE})")
    parser.add_argument("--table", type=Path, default=None,
                        help="markdown table (default: the results path with .md)")
    parser.add_argument("--threads-per-job", type=int, default=None,
                        help="OMP/MKL threads of each run (CPU); default: torch's choice")
    parser.add_argument("--time-budget", type=duration, default=None, metavar="DURATION",
                        help="stop the grid and the fit in progress after this long (e.g. 9m); the "
                             "same command continues (see the description)")
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
    args.results = args.results or args.runs_dir / RESULTS_FILE
    for config in args.config:  # names stay names: each fit reads the recipe of its own install
        try:
            resolve_config(config)
        except ValueError as error:
            parser.error(str(error))
    if args.threads_per_job is not None and args.threads_per_job < 1:
        parser.error(f"--threads-per-job must be >= 1, got {args.threads_per_job}")
    bad_seeds = [seed for seed in args.seeds if not 0 <= seed <= MAX_SEED]
    if bad_seeds:
        parser.error(f"--seeds must be integers from 0 to {MAX_SEED} (2**32 - 1), got {bad_seeds}")
    if len(set(args.seeds)) != len(args.seeds) or len(set(args.arms)) != len(args.arms):
        parser.error("--seeds and --arms must not repeat a value")
    if args.readme and args.table_only and not args.name:
        parser.error("--readme with --table-only needs --name")
    problem = None if args.name is None or args.table_only else folder_name_problem("--name", args.name, "--runs-dir")
    if problem:  # the runs are trained in <runs-dir>/<name>
        raise _refuse(ValueError(problem))
    stray = [a for a in overrides if a.startswith("--") and not a.startswith(
        ("--trainer.", "--model.", "--data.", "--checkpoint.", "--lr_monitor."))]
    if stray:
        parser.error(f"unknown arguments {stray}: only LightningCLI overrides (--trainer.*, "
                     "--model.*, --data.*, --checkpoint.*) are passed through")
    return args, overrides


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
        if missing := missing_extra("matplotlib", "--figures"):
            raise ValueError(missing)
        check_writable_dir(args.figures, "--figures")
    for option, _, path in outputs:
        check_output(option, path)
    read_results(args.results)
    if args.readme:
        page_block(args.readme, *readme_markers(args.name))
        if not args.table_only:
            page_block(args.readme, *readme_markers(args.name, "ablation-progress"))


def grid_of(args: argparse.Namespace, overrides: list[str]) -> Grid:
    """The grid that the command line (:func:`parse_args`) names."""
    return Grid(args.config, overrides, runs_dir=args.runs_dir, results=args.results, table=args.table,
                name=args.name, arms=args.arms, seeds=args.seeds, threads_per_job=args.threads_per_job,
                time_budget=args.time_budget)


def figure_of(entries: Sequence[dict], figures: Path) -> Path:
    """The file :func:`plot_figure` writes for ``entries``: of the recipe of the best-validation
    URPE run. ``ValueError`` when no URPE run has finished."""
    best = best_run(entries)
    if best is None:
        raise ValueError("--figures plots a finished urpe run, and there is none"
                         + (f" of {entries[0].get('recipe')}" if entries else ""))
    return figure_path(figures, best.get("recipe"))


def plot_figure(results: Path, name: str | None, runs_dir: Path, figures: Path) -> str:
    """B and C of the best-validation URPE run of recipe ``name`` (any, when None) in ``results``
    and B of RPE with the same seed, in ``figures``; its path, or why there is none yet."""
    entries = [e for e in read_results(results) if name in (None, e.get("recipe"))]
    if best_run(entries) is None:
        return f"no figure yet: no urpe run of {name} has finished"
    from graphormer_urpe.cli.learned_tables import plot_learned_tables  # matplotlib only when plotting

    return str(plot_learned_tables(entries, runs_dir, figures))


def _late(problems: list[str], write: Callable[[], Any]) -> Any:
    """``write()``, done after the runs; a failure (the README's markers removed meanwhile, a full
    disk, a file made read-only) is said in one line and added to ``problems``, and the other
    outputs are still written."""
    try:
        return write()
    except (ValueError, OSError) as error:
        problems.append(f"graphormer-urpe-ablation: error: {error}")
        print(problems[-1], file=sys.stderr, flush=True)


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
        print(plot_figure(args.results, args.name, args.runs_dir, args.figures))


def main(argv: Sequence[str] | None = None) -> None:
    """The command (returns None: a console script exits with main()'s value)."""
    args, overrides = parse_args(argv)
    if args.table_only:
        return table_only(args)
    if missing := missing_extra("optuna", "graphormer-urpe-ablation"):  # the grid is an Optuna study
        raise _refuse(ValueError(missing))
    from optuna.exceptions import StorageInternalError

    start = time.perf_counter()
    problems: list[str] = []
    with contextlib.ExitStack() as held:  # the run directories are let go when main() ends
        try:
            grid = grid_of(args, overrides)
            args.name = grid.name
            check_files(args, grid.table, args.figures and figure_path(args.figures, grid.name))
            check_creatable_dir(args.runs_dir, "--runs-dir")
            held.callback(grid.release)
            grid.lock()
            grid.open()
            grid.check_runs(reported=bool(args.readme))
        except ValueError as error:  # the recipe refused by fit's parser, another recipe's study
            raise _refuse(error) from None
        if args.readme:  # however the grid ends, where all its runs stand
            held.callback(_late, problems, lambda: write_progress_block(
                args.readme, grid.name, grid.progress, grid.max_steps))
        try:
            with stop_on_signals():
                results = grid.run()
        except RunsFailed as failed:  # each named; the others are finished and published
            raise SystemExit(str(failed)) from None
        except (KeyboardInterrupt, StoppedBySignal) as stop:  # the fit in progress saved and stopped
            grid.stopped()
            signum = getattr(stop, "signum", signal.SIGINT)
            print(f"graphormer-urpe-ablation: stopped by {signal.Signals(signum).name}; every run "
                  "keeps its last.ckpt: the same command continues", file=sys.stderr, flush=True)
            raise SystemExit(128 + signum) from None
        except StorageInternalError as error:
            raise SystemExit(f"graphormer-urpe-ablation: error: the study database {grid.dir / STUDY_DB} "
                             f"failed ({storage_error(error)})") from None
        table = _late(problems, grid.publish)
        if table is not None:
            print(table)
        if args.readme:
            _late(problems, lambda: write_readme_block(args.readme, grid.name, args.results))
        if args.figures:
            _late(problems, lambda: print(plot_figure(args.results, grid.name, args.runs_dir, args.figures)))
    print(f"graphormer-urpe-ablation: {grid.name} took {(time.perf_counter() - start) / 60:.1f} "
          f"min ({results} runs finished)")
    if problems:
        raise SystemExit(1)


if __name__ == "__main__":
    main()

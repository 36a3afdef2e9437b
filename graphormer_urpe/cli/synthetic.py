"""``graphormer-urpe-synthetic``: the paper's synthetic grid (Luo et al., 2022, Figure 1), resumable.

Trains ``task x vocab x position scheme x seed`` on Position Identification and Even Token
Prediction (:mod:`graphormer_urpe.training.studies.synthetic`). Each finished cell is kept in
``--run-dir`` (``<cell>.json`` and ``<cell>.pt``, the weights for ``graphormer-urpe-plot``), so a
killed grid resumes where it stopped. The table is printed and goes to ``--results-dir``
(``synthetic.json``, ``synthetic.csv``; by default ``--run-dir``) and, when given, into
``--markdown`` (between the ``results`` markers).
Same as ``python -m graphormer_urpe.cli.synthetic``.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Sequence

from graphormer_urpe.nn.sequence import POSITION_SCHEMES
from graphormer_urpe.training.studies.synthetic import (
    TASK_OVERRIDES, TASKS, CellResult, TrainConfig, run_grid, task_config, write_reports)
from graphormer_urpe.utils.process import run_command


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="graphormer-urpe-synthetic",
        description="Train the paper's synthetic grid (task x vocab x position scheme x seed).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--vocab-sizes", nargs="+", type=int, default=[1000, 10000])
    parser.add_argument("--schemes", nargs="+", default=list(POSITION_SCHEMES),
                        choices=POSITION_SCHEMES)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--run-dir", type=Path, default=Path("runs/synthetic"),
                        help="per-cell metrics and weights (the resume state)")
    parser.add_argument("--results-dir", type=Path, default=None,
                        help="where synthetic.json / synthetic.csv go (None: --run-dir; '' to skip)")
    parser.add_argument("--markdown", type=Path, default=None,
                        help="markdown file whose results block is rewritten (None: no page is written)")
    parser.add_argument("--no-progress", action="store_true")
    training = parser.add_argument_group(
        "training", "override a TrainConfig field for every task (default: the task's own value, "
        f"TrainConfig defaults + TASK_OVERRIDES = {TASK_OVERRIDES})")
    for f in dataclasses.fields(TrainConfig):
        training.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=None,
                              help=f"TrainConfig default: {f.default}")
    return parser


def run(argv: Sequence[str] | None = None) -> list[CellResult]:
    """Train the grid given by the command line ``argv``, write the reports, return the cells."""
    args = _parser().parse_args(argv)
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)}
    configs = {task: task_config(task, **overrides) for task in args.tasks}
    results = run_grid(args.tasks, args.vocab_sizes, args.schemes, args.seeds, configs,
                       args.run_dir, progress=not args.no_progress)
    command = "graphormer-urpe-synthetic " + " ".join(sys.argv[1:] if argv is None else argv)
    results_dir = args.run_dir if args.results_dir is None else args.results_dir
    table = write_reports(results, results_dir if str(results_dir) not in ("", ".") else None,
                          args.markdown if str(args.markdown or "") not in ("", ".") else None,
                          command.strip())
    print(table)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    """``graphormer-urpe-synthetic``: exit status 0 after a successful grid; stopped (Ctrl-C,
    SIGTERM, SIGHUP), one line and 128 + the signal, its finished cells kept for the same command
    to skip."""
    def work() -> int:
        run(argv)
        return 0

    return run_command("graphormer-urpe-synthetic", work)


if __name__ == "__main__":
    sys.exit(main())

"""``graphormer-urpe-hpopt``: hyperparameter search with Optuna over any LightningCLI key.

    graphormer-urpe-hpopt --space space.yaml --config csv --study esol \\
        --n-trials 20 [--timeout 30m] [LightningCLI overrides for every trial, e.g. --trainer.max_epochs 10]

Each trial is an ordinary ``graphormer-urpe fit`` in its own process and run directory
(:mod:`graphormer_urpe.training.studies.search`); the space file, the study, resuming, several
workers and every refusal are described in docs/hpopt.md. Bad input is one line on stderr and
exit status 2, before any trial runs.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from graphormer_urpe.cli.arguments import duration, folder_name_problem
from graphormer_urpe.training.recipes import resolve_config
from graphormer_urpe.training.studies.search import BEST_CONFIG, FIT_LOG, PROG, open_search
from graphormer_urpe.training.studies.search_space import Refused, check_overrides, read_space
from graphormer_urpe.training.studies.study import STUDY_DB, fail_dead_trials, safe_url
from graphormer_urpe.utils.extras import missing_extra


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, as every refusal
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, allow_abbrev=False, description="Hyperparameter search with Optuna over any graphormer-urpe fit key: "
                                 "each trial one fit in its own run directory (docs/hpopt.md in the source checkout).",
                     usage=f"{PROG} --space SPACE.yaml --config RECIPE.yaml [--config ...] "
                           "(--n-trials N | --timeout T) [options] [fit overrides...]",
                     epilog="Other arguments are LightningCLI overrides for every trial's fit "
                            "(e.g. --trainer.max_epochs 10); after '--' everything is.")
    parser.add_argument("--space", type=Path, required=True, help="the search space (YAML)")
    parser.add_argument("--config", action="append", default=[], required=True,
                        help="the base recipe: a packaged recipe's name or a fit config file, repeatable, in order")
    parser.add_argument("--study", default="hpopt", help="the study's name (default: hpopt)")
    parser.add_argument("--runs-dir", type=Path, default=Path("runs/hpopt"),
                        help="trials run in <runs-dir>/<study>/trial-<n> (default: runs/hpopt)")
    parser.add_argument("--storage", help="an Optuna database URL shared by all workers (default: "
                                          "sqlite:///<runs-dir>/<study>/study.db)")
    parser.add_argument("--n-trials", type=int, help="run until the study holds this many finished "
                                                     "(complete or pruned) trials")
    parser.add_argument("--timeout", type=duration, help="start no trial after this long (30m, 1h30m, 600)")
    parser.add_argument("--sampler", choices=("tpe", "random"), default="tpe")
    parser.add_argument("--seed", type=int, help="the sampler's seed (offset by the trials already "
                                                 "in the study, so a resumed search draws new values)")
    parser.add_argument("--startup-trials", type=int, default=5,
                        help="trials drawn at random before TPE models the space, and complete "
                             "trials before the pruner prunes (default: 5)")
    parser.add_argument("--pruner", choices=("median", "none"), default="median",
                        help="median: stop a trial whose metric is worse than the median of "
                             "earlier trials' at the same validation (default)")
    parser.add_argument("--warmup-validations", type=int, default=1,
                        help="validations of each trial that are never pruned (default: 1)")
    return parser


def parse_args(argv: list[str] | None):
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        at = argv.index("--")
        args, overrides = parser.parse_args(argv[:at]), argv[at + 1:]
    else:
        args, overrides = parser.parse_known_args(argv)
    if args.n_trials is None and args.timeout is None:
        parser.error("give --n-trials, --timeout or both")
    for name in ("n_trials", "startup_trials", "warmup_validations"):
        value = getattr(args, name)
        if value is not None and value < (1 if name == "n_trials" else 0):
            parser.error(f"--{name.replace('_', '-')} must be >= {1 if name == 'n_trials' else 0}, got {value}")
    try:
        args.config = [resolve_config(config) for config in args.config]
    except ValueError as error:
        parser.error(str(error))
    problem = folder_name_problem("--study", args.study, "--runs-dir")
    if problem:
        parser.error(problem)
    return args, overrides


def search(args, overrides: list[str]) -> int:
    """The search the arguments ask for: its exit status (:class:`Refused` for bad input)."""
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    space = read_space(args.space)
    check_overrides(overrides, space)
    for path in args.config:
        if not Path(path).is_file():
            raise Refused(f"--config {path}: no such file")
    study_dir = args.runs_dir.resolve() / args.study
    url = args.storage or f"sqlite:///{study_dir / STUDY_DB}"
    run = open_search(args.study, url, "--storage" if args.storage else "the study database", study_dir,
                      [str(Path(path).resolve()) for path in args.config], overrides, space,
                      {"name": args.pruner, "startup_trials": args.startup_trials,
                       "warmup_validations": args.warmup_validations},
                      args.sampler, args.seed, args.startup_trials)
    for number in fail_dead_trials(run.study):
        print(f"trial {number}: its worker on this machine is gone; marked failed, its values queued again",
              flush=True)
    print(f"study {args.study!r} ({safe_url(url)}): {run.finished()} finished trial(s); objective "
          f"{run.monitor} ({'maximised' if run.objective['mode'] == 'max' else 'minimised'}); trials in {study_dir}",
          flush=True)
    status = run.run_trials(args.n_trials, deadline)
    if status != 0:
        return status
    run.write_outputs()
    best = run.best()
    if best is None:
        print(f"{PROG}: error: no complete trial yet; see the trials' {FIT_LOG} under {study_dir}",
              file=sys.stderr)
        return 1
    print(f"best: trial {best.number}, {run.monitor} {best.value:.6g}; config {study_dir / BEST_CONFIG} "
          f"(graphormer-urpe {run.recipe_line()})", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    from graphormer_urpe.utils.process import run_command

    args, overrides = parse_args(argv)

    def work() -> int:
        try:
            if missing := missing_extra("optuna", PROG):
                raise Refused(missing)
            return search(args, overrides)
        except Refused as exc:
            print(f"{PROG}: error: {exc}", file=sys.stderr)
            return 2

    return run_command(PROG, work)


if __name__ == "__main__":
    sys.exit(main())

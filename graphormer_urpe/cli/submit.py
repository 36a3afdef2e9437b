"""``graphormer-urpe-submit``: an OGB-LSC PCQM4M / PCQM4Mv2 submission from a Lightning checkpoint.

    graphormer-urpe-submit --dataset pcqm4m --ckpt runs/pcqm4m_urpe/checkpoints/last.ckpt \\
        --root DIR --out-dir submission/

Checks the split dict, computes the valid MAE with OGB's evaluator, predicts every test set and
checks counts and finiteness, and only then writes the evaluator's files
(:mod:`graphormer_urpe.training.submission`), put in place together; a refusal or a stop is one
line on stderr with nothing written, a success one JSON line on stdout.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from graphormer_urpe.cli.arguments import positive_int
from graphormer_urpe.data.lsc_layouts import LAYOUTS
from graphormer_urpe.utils.process import run_command

PROG = "graphormer-urpe-submit"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument("--dataset", required=True, choices=sorted(LAYOUTS),
                        help="pcqm4m: OGB-LSC 2021 (v1); pcqm4mv2: PCQM4Mv2")
    parser.add_argument("--ckpt", required=True, help="Lightning checkpoint of an 'ogb'-featurized model")
    parser.add_argument("--root", required=True, help="directory holding the version's OGB-LSC folder")
    parser.add_argument("--out-dir", required=True, type=Path)
    parser.add_argument("--batch-size", type=positive_int, default=1024)
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--precision", default="32-true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from graphormer_urpe.training.submission import submit  # Lightning is imported after the arguments

    def work() -> int:
        try:
            summary = submit(args)
        except ValueError as exc:  # SubmissionError, CheckpointError, the data layer's input errors
            print(f"{PROG}: error: {exc}", file=sys.stderr)
            return 2
        print(json.dumps(summary))
        return 0

    return run_command(PROG, work)


if __name__ == "__main__":
    sys.exit(main())

"""``graphormer-urpe-submit``: an OGB-LSC PCQM4M / PCQM4Mv2 submission from a Lightning checkpoint.

    graphormer-urpe-submit --dataset pcqm4m --ckpt runs/pcqm4m_urpe/checkpoints/last.ckpt \\
        --root DIR --out-dir submission/

``--root DIR`` holds the OGB-LSC layout of the version (``DIR/pcqm4m_kddcup2021`` or
``DIR/pcqm4m-v2``, see :mod:`graphormer_urpe.data.ogb_lsc`). Checks the split dict (rows in
range and non-negative, splits disjoint, train / valid labelled, the test sets of their official
sizes), computes the valid MAE with OGB's evaluator (``PCQM4MEvaluator`` / ``PCQM4Mv2Evaluator``;
a non-finite MAE is refused), predicts every test set and checks counts and finiteness, and only
then writes the files with the evaluator's ``save_test_submission``:

=========  ===============================================================================
pcqm4m     ``y_pred_pcqm4m.npz`` (test, 377,423 predictions)
pcqm4mv2   ``y_pred_pcqm4m-v2_test-dev.npz`` (147,037), ``y_pred_pcqm4m-v2_test-challenge.npz``
           (147,432)
=========  ===============================================================================

Anything refused is one line on stderr and exit status 2, with nothing written. A final JSON
line on stdout summarises a successful run. Stopped (Ctrl-C, SIGTERM, SIGHUP), it says so in one
line and leaves the output folder as it was (exit status 128 + the signal): the files are put in
place together, each whole.
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

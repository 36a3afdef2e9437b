r"""Render learned URPE tables (the paper's Figure 2) to PNG.

Two kinds of checkpoint are understood (:mod:`graphormer_urpe.training.studies.learned_tables`):

* a sequence model from the synthetic grid (``runs/synthetic/<cell>.pt``, written by
  ``graphormer-urpe-synthetic``): writes ``<stem>-B.png`` and ``<stem>-C.png`` (the Toeplitz
  matrices ``T_ij = table[j - i]`` of the bias B and the URPE scale C, layers x heads) and
  ``<stem>-offsets.png`` (the tables as curves over the offset ``j - i``, one line per head).
* a graph model (a Lightning checkpoint of a Graphormer): writes ``<stem>-spd.png``: curves of B
  and of each layer's C over shortest-path distance, one line per head, with the "unreachable"
  and graph-token slots as separate points at the right.

Usage::

    graphormer-urpe-plot runs/synthetic/pi-v1000-urpe-s0.pt --out docs/figures
    graphormer-urpe-plot lightning_logs/version_0/checkpoints/last.ckpt --out docs/figures

(matplotlib is an optional dependency: ``pip install 'graphormer-urpe[plot]'``.)
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Sequence

if importlib.util.find_spec("matplotlib") is None:  # the optional ``plot`` extra
    raise SystemExit("graphormer-urpe-plot needs matplotlib: pip install 'graphormer-urpe[plot]'")

from graphormer_urpe.training.studies.learned_tables import plot_checkpoint  # noqa: E402


def main(argv: Sequence[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("checkpoints", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=Path("docs/figures"))
    parser.add_argument("--length", type=int, default=None,
                        help="sequence: size of the Toeplitz matrices drawn (default: max_len)")
    parser.add_argument("--max-offset", type=int, default=None,
                        help="sequence: offsets shown in the curves (default: all)")
    parser.add_argument("--max-spd", type=int, default=None,
                        help="graph: largest distance on the x axis (default: the table's)")
    args = parser.parse_args(argv)
    paths = []
    for checkpoint in args.checkpoints:
        paths += plot_checkpoint(checkpoint, args.out, args.length, args.max_offset, args.max_spd)
    for path in paths:
        print(path)
    return paths


def console_main() -> int:
    """``graphormer-urpe-plot``: :func:`main` with an exit status: 2 and one line for a file it
    cannot plot (damaged, crafted, or neither kind of model)."""
    try:
        main()
    except ValueError as exc:
        print(f"graphormer-urpe-plot: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    main()

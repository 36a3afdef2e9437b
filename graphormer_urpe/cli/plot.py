r"""Render learned URPE tables (the paper's Figure 2), or a fit's training curves, to PNG.

    graphormer-urpe-plot runs/synthetic/pi-v1000-urpe-s0.pt --out docs/figures
    graphormer-urpe-plot runs/zinc_quickstart/checkpoints/last.ckpt --out figures
    graphormer-urpe-plot curves runs/zinc_quickstart -o curves.png

A sequence model of the synthetic grid gives ``<stem>-B.png``, ``<stem>-C.png`` and
``<stem>-offsets.png``, a graph model ``<stem>-spd.png`` (:mod:`graphormer_urpe.cli.learned_tables`);
``curves`` draws a fit's CSV metrics (:mod:`graphormer_urpe.training.curves`). Needs the ``plot`` extra.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from graphormer_urpe.utils.extras import missing_extra
from graphormer_urpe.utils.process import run_command

PROG = "graphormer-urpe-plot"
#: the first argument that draws a fit's curves instead of a checkpoint's tables
CURVES = "curves"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                     epilog=f"{PROG} {CURVES} RUN_DIR [-o FILE.png] draws a fit's training curves "
                                            f"({PROG} {CURVES} --help).",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("checkpoints", nargs="+", type=Path,
                        help="a synthetic-grid model (.pt) or a Lightning checkpoint of a Graphormer")
    parser.add_argument("--out", type=Path, default=Path("docs/figures"), help="the folder the PNGs go to")
    parser.add_argument("--length", type=int, default=None,
                        help="sequence: size of the Toeplitz matrices drawn (default: max_len)")
    parser.add_argument("--max-offset", type=int, default=None,
                        help="sequence: offsets shown in the curves (default: all)")
    parser.add_argument("--max-spd", type=int, default=None,
                        help="graph: largest distance on the x axis (default: the table's)")
    return parser


def _curves_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"{PROG} {CURVES}",
                                     description="Draw a fit's training curves from its CSV metrics (the "
                                                 "newest csv/version_N of the run directory).")
    parser.add_argument("run", type=Path, metavar="RUN_DIR",
                        help="a fit's --trainer.default_root_dir, a csv/version_N folder or a metrics.csv")
    parser.add_argument("-o", "--out", type=Path, default=None,
                        help="the PNG to write (default: RUN_DIR/curves.png)")
    return parser


def main(argv: Sequence[str] | None = None) -> list[Path]:
    """Draw what the command line asks for; the PNGs written. ``ValueError`` (one line) for what
    cannot be drawn, ``SystemExit`` (exit status 2, one line) without matplotlib."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == [CURVES]:
        args = _curves_parser().parse_args(argv[1:])
        _require_matplotlib()
        from graphormer_urpe.training.curves import plot_curves

        run_dir = args.run if args.run.is_dir() else args.run.parent
        paths = [plot_curves(args.run, args.out or run_dir / "curves.png")]
    else:
        args = _parser().parse_args(argv)
        _require_matplotlib()
        from graphormer_urpe.cli.learned_tables import plot_checkpoint

        paths = []
        for checkpoint in args.checkpoints:
            paths += plot_checkpoint(checkpoint, args.out, args.length, args.max_offset, args.max_spd)
    for path in paths:
        print(path)
    return paths


def _require_matplotlib() -> None:
    missing = missing_extra("matplotlib", PROG)
    if missing:
        print(f"{PROG}: error: {missing}", file=sys.stderr)
        raise SystemExit(2)


def console_main() -> int:
    """``graphormer-urpe-plot``: :func:`main` with an exit status: 2 and one line for a file it
    cannot plot (damaged, crafted, or neither kind of model); a stop or a full disk is
    :func:`~graphormer_urpe.utils.process.run_command`'s one line."""
    def work() -> int:
        try:
            main()
        except ValueError as exc:
            print(f"{PROG}: error: {exc}", file=sys.stderr)
            return 2
        return 0

    return run_command(PROG, work)


if __name__ == "__main__":
    sys.exit(console_main())

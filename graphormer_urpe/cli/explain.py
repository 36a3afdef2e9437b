r"""``graphormer-urpe-explain``: which atoms drive a prediction, drawn on the molecule.

    graphormer-urpe-explain --ckpt runs/zinc_urpe/checkpoints/last.ckpt --input molecules.csv --out explained

Each atom's contribution to the model's raw output for ``--target`` (the value, the logit, the
class's logit) by integrated gradients from a baseline in which every atom is the molecule's mean
atom (:mod:`graphormer_urpe.prediction.explain`); the contributions add up to ``output -
baseline`` up to the quadrature error, which every row reports as ``gap``.

Output in ``--out``: ``<row>.png`` and ``<row>.svg`` per molecule (``row``: the input's 1-based
data row), each atom coloured by its contribution (red raises the output, blue lowers it; the
scale is per molecule) with the value beside it; ``attributions.csv`` (``row``, ``smiles``,
``prediction``, ``output``, ``baseline``, ``gap``, ``atoms``: the contributions in RDKit's atom
order as a JSON list, ``error``); ``index.html``, all of them on one page. A row whose SMILES
cannot be featurized gets its reason in ``error`` and no picture; the others are still drawn.
Several checkpoints of one task (``--ckpt A B C``) explain their mean: every number is the mean
over the models, and a ``std`` column after ``prediction`` holds the spread of their predictions
(as ``graphormer-urpe-predict`` gives it). Input as ``graphormer-urpe-predict`` reads it: a CSV with a ``smiles`` column, or one SMILES a
line.

``--view attention`` draws a second, cheaper view instead: the attention the graph token (whose
final state the prediction head reads) pays to each atom in the last layer, averaged over the
heads; with URPE after the scale ``C``, so a molecule's weights need not add up to 1. It says
where the last layer looks, not how each atom moves the output (no sign, no completeness):
``baseline`` and ``gap`` stay empty.
"""
from __future__ import annotations

import argparse
import csv
import logging
import sys
from pathlib import Path

from graphormer_urpe.cli.arguments import positive_int
from graphormer_urpe.prediction.explain import (
    DEFAULT_STEPS, TABLES, VIEWS, check_options, explain_rows, pictures, write_tables)
from graphormer_urpe.prediction.load import checkpoint_files, files_read, load_models
from graphormer_urpe.prediction.model import DEFAULT_MAX_NODES
from graphormer_urpe.prediction.table import InputRow, read_smiles
from graphormer_urpe.utils.files import check_writable_dir, refuse_overwriting_inputs, unreadable_as_a_file
from graphormer_urpe.utils.process import run_command
from graphormer_urpe.utils.torch_files import CheckpointError

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="graphormer-urpe-explain", description=__doc__.split("\n")[0])
    parser.add_argument("--ckpt", required=True, nargs="+", metavar="CKPT",
                        help="Lightning checkpoint (.ckpt) of any config, or a run directory (its best "
                             "checkpoint) or a folder of them; several (one task): the mean of their "
                             "attributions and predictions, and the predictions' std")
    parser.add_argument("--input", required=True,
                        help="CSV with a 'smiles' column, or one SMILES a line")
    parser.add_argument("--out", required=True, help="directory for the pictures, attributions.csv and index.html")
    parser.add_argument("--target", type=int, default=0,
                        help="which output to explain: target (or class) index, default 0")
    parser.add_argument("--view", choices=VIEWS, default="gradients",
                        help="gradients: each atom's contribution (integrated gradients; default); "
                             "attention: the graph token's attention to each atom in the last layer")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                        help=f"points on the integrated-gradients path (default {DEFAULT_STEPS})")
    parser.add_argument("--max-nodes", type=positive_int, default=DEFAULT_MAX_NODES,
                        help=f"larger molecules get an error row (default {DEFAULT_MAX_NODES})")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def main(argv: list[str] | None = None) -> int:
    """The command: exit status 0; 2 for a refused input or ``--out`` (one line, before any
    work); 1 for a full disk, 130 for Ctrl-C (one line: :func:`~graphormer_urpe.utils.process.run_command`;
    the files already written are whole)."""
    args = build_parser().parse_args(argv)
    return run_command("graphormer-urpe-explain", lambda: _explain(args))


def _fail(message: str) -> int:
    print(f"graphormer-urpe-explain: error: {message}", file=sys.stderr)
    return 2


def _explain(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    source, out = Path(args.input), Path(args.out)
    problem = unreadable_as_a_file(source)
    if problem:
        return _fail(f"--input {source} {problem}")
    if out.exists() and not out.is_dir():
        return _fail(f"--out {out} is a file, not a directory")
    try:
        ckpts, module, rows = _checked(args, source, out)
    except (CheckpointError, ValueError, UnicodeDecodeError, csv.Error) as exc:
        return _fail(str(exc))
    from tqdm import tqdm

    with tqdm(total=len(rows), unit="mol", disable=args.quiet, file=sys.stderr, desc="explain") as progress:
        records = explain_rows(module, rows, out, steps=args.steps, target=args.target,
                               max_nodes=args.max_nodes, view=args.view, progress=progress.update)
    write_tables(out, records, ckpts, args.target, args.view)
    failed = sum(bool(r["error"]) for r in records)
    log.info("explained %d molecules in %s (%d without a picture)", len(records) - failed, out, failed)
    return 0


def _checked(args: argparse.Namespace, source: Path, out: Path) -> tuple[list[Path], object, list[InputRow]]:
    """The checkpoints, their model and the input's rows, once nothing in ``--out`` would
    overwrite what the command reads and ``--out`` can be written (before any work)."""
    ckpts = checkpoint_files(args.ckpt)
    reads = files_read(source, ckpts)
    refuse_overwriting_inputs("--out", [out / name for name in TABLES], reads)
    module = load_models(ckpts)
    check_options(module, args.target, args.steps)
    with read_smiles(source) as table:
        rows = list(table.rows)
    refuse_overwriting_inputs("--out", (path for number in range(1, len(rows) + 1)
                                        for path in pictures(out, number)), reads)
    check_writable_dir(out, "--out")  # read-only, under a file, ...: before the work
    return ckpts, module, rows


if __name__ == "__main__":
    sys.exit(main())

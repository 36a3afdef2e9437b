r"""``graphormer-urpe-explain``: which atoms drive a prediction, drawn on the molecule.

    graphormer-urpe-explain --ckpt runs/zinc_urpe/checkpoints/last.ckpt --input molecules.csv --out explained

Each atom's contribution to the model's raw output for ``--target`` by integrated gradients, or
with ``--view attention`` the graph token's last-layer attention
(:mod:`graphormer_urpe.prediction.explain`). ``--out`` receives ``<row>.png`` and ``<row>.svg`` per
molecule (red raises the output, blue lowers it), ``attributions.csv`` and ``index.html``; a row
that cannot be featurized gets its reason in ``error`` and no picture. Several checkpoints explain
their mean, with a ``std`` column. Input as ``graphormer-urpe-predict`` reads it.
"""
from __future__ import annotations

import argparse
import csv
import html
import json
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from graphormer_urpe.cli.arguments import positive_int, refuse_overwriting_inputs
from graphormer_urpe.prediction.explain import DEFAULT_STEPS, VIEWS, Explanation, check_options, explain_smiles
from graphormer_urpe.cli.predict import files_read
from graphormer_urpe.prediction.load import checkpoint_files, load_models
from graphormer_urpe.prediction.model import DEFAULT_MAX_NODES
from graphormer_urpe.prediction.table import InputRow, read_smiles
from graphormer_urpe.utils.files import (
    atomic_write, check_writable_dir, unreadable_as_a_file)
from graphormer_urpe.utils.process import run_command
from graphormer_urpe.utils.torch_files import CheckpointError

log = logging.getLogger(__name__)

PICTURE_SIZE = 400
#: Molecules explained and drawn together by :func:`explain_rows`.
EXPLAINED_TOGETHER = 64
#: The columns of ``attributions.csv`` (several models add ``std`` after ``prediction``).
COLUMNS = ["row", "smiles", "prediction", "output", "baseline", "gap", "atoms", "error"]
#: The files of ``--out`` beside the pictures (``<row>.png``, ``<row>.svg``).
TABLES = ("attributions.csv", "index.html")


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
    try:  # nothing in --out may overwrite what the command reads, and --out must be writable
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


def atom_colours(values: np.ndarray) -> dict[int, tuple[float, float, float]]:
    """White to red for positive contributions, white to blue for negative, scaled by the
    molecule's largest magnitude."""
    scale = float(np.abs(values).max()) or 1.0
    colours = {}
    for index, value in enumerate(values):
        t = min(1.0, abs(float(value)) / scale)
        colours[index] = (1.0, 1.0 - 0.75 * t, 1.0 - 0.75 * t) if value >= 0 else (1.0 - 0.75 * t, 1.0 - 0.75 * t, 1.0)
    return colours


def pictures(out: Path, number: int) -> tuple[Path, Path]:
    """The PNG and the SVG of data row ``number`` (1-based) in ``out``."""
    return out / f"{number}.png", out / f"{number}.svg"


def draw(smiles: str, featurizer: str, values: np.ndarray, png: Path, svg: Path) -> None:
    """The molecule with each atom coloured by its contribution and labelled with it."""
    from rdkit import Chem
    from rdkit.Chem.Draw import rdMolDraw2D

    from graphormer_urpe.data.featurize import clean_smiles

    mol = Chem.MolFromSmiles(clean_smiles(smiles) if featurizer == "ogb" else smiles)
    if mol is None or mol.GetNumAtoms() != len(values):
        raise ValueError(f"the drawing's {0 if mol is None else mol.GetNumAtoms()} atoms do not match "
                         f"the model's {len(values)}")
    for atom, value in zip(mol.GetAtoms(), values):
        atom.SetProp("atomNote", f"{value:+.2f}")
    colours = atom_colours(values)
    atoms = list(range(len(values)))
    radii = {index: 0.45 for index in atoms}
    for drawer, path in ((rdMolDraw2D.MolDraw2DCairo(PICTURE_SIZE, PICTURE_SIZE), png),
                         (rdMolDraw2D.MolDraw2DSVG(PICTURE_SIZE, PICTURE_SIZE), svg)):
        drawer.drawOptions().annotationFontScale = 0.7
        rdMolDraw2D.PrepareAndDrawMolecule(drawer, mol, highlightAtoms=atoms, highlightAtomColors=colours,
                                           highlightAtomRadii=radii, highlightBonds=[])
        drawer.FinishDrawing()
        data = drawer.GetDrawingText()
        with atomic_write(path, binary=isinstance(data, bytes)) as output:
            output.write(data)


def explain_rows(module, rows: Sequence[InputRow], out: Path, *, steps: int = DEFAULT_STEPS, target: int = 0,
                 max_nodes: int = DEFAULT_MAX_NODES, view: str = "gradients",
                 progress: Callable[[int], object] | None = None) -> list[dict]:
    """Explain each of ``rows`` (data rows 1, 2, ... in order) in ``view`` and draw it in ``out``
    (:func:`pictures`) as soon as its group of :data:`EXPLAINED_TOGETHER` is explained: one
    record per row, the columns of ``attributions.csv`` (a row that cannot be explained or drawn
    gets its reason in ``error``). ``progress(n)`` after each group of ``n`` rows."""
    records = []
    for start in range(0, len(rows), EXPLAINED_TOGETHER):
        part = rows[start:start + EXPLAINED_TOGETHER]
        results = explain_smiles(module, [("" if row.error else row.smiles) for row in part], steps, target,
                                 max_nodes, view)
        for number, (row, result) in enumerate(zip(part, results), start + 1):
            records.append(_record(number, row, result, module.facts.featurizer, out, view))
        if progress is not None:
            progress(len(part))
    return records


def _record(number: int, row: InputRow, result: Explanation | str, featurizer: str, out: Path,
            view: str) -> dict:
    """Row ``number``'s record, its pictures drawn when it is explained."""
    record = {"row": number, "smiles": row.smiles, "error": row.error or ""}
    if row.error or not isinstance(result, Explanation):
        record["error"] = record["error"] or result
        return record
    try:
        draw(row.smiles, featurizer, result.atoms, *pictures(out, number))
    except ValueError as exc:
        record["error"] = f"cannot draw: {exc}"
    record.update(prediction=f"{result.prediction:.6g}", output=f"{result.output:.6g}",
                  atoms=json.dumps([round(float(v), 5) for v in result.atoms]))
    if result.std is not None:
        record["std"] = f"{result.std:.6g}"
    if view == "gradients":
        record.update(baseline=f"{result.baseline:.6g}", gap=f"{result.gap:.3g}")
    return record


def write_tables(out: Path, records: list[dict], ckpts: Sequence[Path], target: int, view: str) -> None:
    """``attributions.csv`` and ``index.html`` (:data:`TABLES`) of ``records`` in ``out``, each
    written whole; several ``ckpts`` add the ``std`` column."""
    columns = COLUMNS if len(ckpts) == 1 else [*COLUMNS[:3], "std", *COLUMNS[3:]]
    with atomic_write(out / TABLES[0]) as table:
        writer = csv.DictWriter(table, columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(records)
    with atomic_write(out / TABLES[1]) as page:
        page.write(index_html(records, ", ".join(map(str, ckpts)), target, view))


def index_html(records: list[dict], ckpt: str, target: int, view: str = "gradients") -> str:
    """One page: every molecule's picture, SMILES, prediction and (integrated gradients) the gap."""
    cells = []
    for record in records:
        text = html.escape(record["smiles"])
        if record["error"]:
            cells.append(f'<figure><figcaption>{record["row"]}: {text}<br><b>{html.escape(record["error"])}'
                         "</b></figcaption></figure>")
        else:
            detail = (f'output {record["output"]}, baseline {record["baseline"]}, gap {record["gap"]}'
                      if view == "gradients" else f'output {record["output"]}')
            spread = f' ± {record["std"]}' if record.get("std") else ""
            cells.append(f'<figure><img src="{record["row"]}.svg" alt="{text}"><figcaption>{record["row"]}: {text}<br>prediction '
                         f'{record["prediction"]}{spread} ({detail})</figcaption></figure>')
    if view == "gradients":
        title, legend = ("Atom contributions", "red atoms raise it, blue lower it (scale per molecule); integrated "
                         "gradients from the molecule with every atom replaced by its mean atom (the baseline).")
    else:
        title, legend = ("Graph-token attention", "the deeper the red, the more attention the graph token pays to "
                         "the atom in the last layer (mean over heads, after URPE's C; scale per molecule).")
    return ("<!doctype html><meta charset=\"utf-8\"><title>graphormer-urpe-explain</title>"
            "<style>body{font-family:sans-serif}figure{display:inline-block;width:320px;margin:8px;"
            "vertical-align:top}img{width:300px}figcaption{font-size:12px;word-break:break-all}</style>"
            f"<h1>{title}</h1><p>Checkpoint(s) {html.escape(str(ckpt))}, output {target}: {legend}</p>"
            + "".join(cells) + "\n")


if __name__ == "__main__":
    sys.exit(main())

"""The prediction table that ``graphormer-urpe-predict`` and ``graphormer-urpe predict`` share:
its rows (a CSV with a ``smiles`` column, one SMILES a line, or a list) and the CSV they are
written to (:class:`PredictionTable`)."""
from __future__ import annotations

import contextlib
import csv
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from graphormer_urpe.utils.files import atomic_write
from graphormer_urpe.data.task import get_task


@dataclass
class InputRow:
    smiles: str  #: as given (echoed to the output)
    error: str = ""
    fields: list[str] = field(default_factory=list)  #: all columns of a CSV row (empty otherwise)


# ----------------------------------------------------------------------------------- input
@dataclass
class SmilesInput:
    """An opened input: ``columns`` (the CSV header, ``None`` for one SMILES a line or a list), its
    rows, and how many there are (:meth:`count`)."""

    path: Path | None  #: the file, ``None`` for SMILES given as a list
    columns: list[str] | None
    rows: Iterator[InputRow]
    length: int | None = None  #: the number of rows where known without reading the file

    def count(self) -> int:
        """The number of rows: ``length``, else the file's lines after the header."""
        if self.length is not None:
            return self.length
        return max(count_lines(self.path) - (self.columns is not None), 0)


def smiles_list(smiles: Sequence[str]) -> SmilesInput:
    """SMILES given in memory as an input, one row each, in order."""
    return SmilesInput(None, None, (InputRow(text) for text in smiles), len(smiles))


def open_smiles(handle, path: Path) -> SmilesInput:
    """The input of ``handle`` (text, ``newline=""``), its rows read lazily; a first line the CSV
    reader cannot read is no header: the file is one SMILES a line."""
    first = handle.readline()
    try:
        header = next(csv.reader([first]), [])
    except csv.Error:
        header = [first]
    names = [c.strip().lower() for c in header]
    if "smiles" in names:
        column = names.index("smiles")
        return SmilesInput(path, header, _csv_rows(csv.reader(handle), column, len(header)))
    if len(header) > 1:
        raise ValueError(f"{path}: CSV header {header} has no 'smiles' column")

    def lines() -> Iterator[InputRow]:
        for number, line in enumerate(itertools.chain([first] if first else [], handle), start=1):
            line = line.rstrip("\r\n")
            if len(line) > csv.field_size_limit():  # as long as the CSV reader refuses a field
                yield _unreadable(number, f"longer than the field limit ({csv.field_size_limit()} characters)")
            else:
                yield InputRow(line)

    return SmilesInput(path, None, lines())


def _unreadable(line: int, problem: str, width: int = 0) -> InputRow:
    """The error row of input line ``line``, which cannot be read (``problem``). Its fields are
    left empty: one over the CSV reader's limit would make the output as hard to read."""
    return InputRow("", error=f"line {line} cannot be read: {problem}", fields=[""] * width)


@contextlib.contextmanager
def read_smiles(path: Path) -> Iterator[SmilesInput]:
    """The SMILES file at ``path`` (UTF-8, a byte-order mark ignored) opened for the block
    (:func:`open_smiles`)."""
    with open(path, newline="", encoding="utf-8-sig") as handle:
        yield open_smiles(handle, path)


def _csv_rows(reader, column: int, width: int) -> Iterator[InputRow]:
    """The rows after the header; a record the reader cannot read (a field over its limit) is an
    error row naming its line, and reading goes on at the next line."""
    while True:
        try:
            fields = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:  # the reader has dropped the line and starts afresh after it
            yield _unreadable(reader.line_num + 1, str(exc), width)
            continue
        row = InputRow(fields[column] if column < len(fields) else "", fields=fields)
        if len(fields) != width:
            row.error = f"row has {len(fields)} fields, the header {width}"
            row.fields = (fields + [""] * width)[:width]
        yield row


def count_lines(path: Path) -> int:
    """Newlines in ``path`` (the progress bar's total; a quick binary pass)."""
    count = 0
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            count += block.count(b"\n")
    return count


# --------------------------------------------------------------------------------- output
def input_names(columns: Sequence[str], outputs: Sequence[str]) -> list[str]:
    """The output's names of the input's ``columns`` beside its own ``outputs`` (and ``error``):
    ``input_`` before each name the output uses."""
    taken = {"error", *outputs}
    names = []
    for name in columns:
        while name in taken:
            name = f"input_{name}"
        taken.add(name)
        names.append(name)
    return names


class PredictionTable:
    """Writes prediction rows to a CSV handle: ``row``, the input's columns (``smiles`` when
    ``columns`` is None), the ``predictions`` columns (:func:`prediction_columns`), ``error``;
    ``\\n`` line endings."""

    def __init__(self, handle, predictions: Sequence[str], columns: Sequence[str] | None = None) -> None:
        predictions = list(predictions)
        inputs = input_names(["smiles"] if columns is None else columns, ["row", *predictions])
        self._echo_fields = columns is not None
        self._writer = csv.writer(handle, lineterminator="\n")
        self._writer.writerow(["row", *inputs, *predictions, "error"])
        self.rows_written = 0
        self.failed = 0

    def write(self, rows: Sequence[InputRow], predictions: np.ndarray) -> None:
        for row, pred in zip(rows, predictions):
            self.rows_written += 1
            self.failed += bool(row.error)
            values = ["" if row.error else f"{v:.6g}" for v in pred]
            echoed = row.fields if self._echo_fields else [row.smiles]
            self._writer.writerow([self.rows_written, *echoed, *values, row.error])


def write_predictions(path: str | Path, rows: Sequence[InputRow], predictions: np.ndarray,
                      prediction_names: Sequence[str], columns: Sequence[str] | None = None) -> None:
    """The :class:`PredictionTable` of ``rows`` and ``predictions`` written whole to ``path``."""
    with atomic_write(path) as output:
        PredictionTable(output, prediction_names, columns).write(rows, predictions)


def prediction_columns(module) -> list[str]:
    """The prediction columns of a loaded model (named after the targets where the checkpoint
    records them), then, for a model that ``predicts_std``, ``std...`` for each."""
    facts = module.facts
    names = module.hparams.get("target_names")
    columns = get_task(facts.task).prediction_columns(
        facts.num_targets, list(names) if names is not None else None)
    if getattr(module, "predicts_std", False):  # each column's std after them
        columns += ["std" + column.removeprefix("prediction") for column in columns]
    return columns

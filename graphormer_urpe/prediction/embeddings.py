"""Molecule embeddings beside the predictions (``graphormer-urpe-predict --embeddings``): what
the model's output head reads, one row per input row, written whole or not at all.

``--embeddings FILE.npy``: float32 ``[rows, D]``, row ``i`` the graph token's final vector of
the output's data row ``i + 1`` (:meth:`~graphormer_urpe.nn.graphormer.Graphormer.embed`);
``np.load(FILE)``. ``--atom-embeddings FILE.npz``: ``embeddings`` float32 ``[atoms, D]``, every
atom's final vector, and ``offsets`` int64 ``[rows + 1]``: row ``i``'s atoms (in RDKit's atom
order of its SMILES, hydrogens implicit) are ``embeddings[offsets[i]:offsets[i + 1]]``. A row
without a prediction (its reason in the table's ``error`` column) is a row of NaN in the
``.npy`` and has no atoms in the ``.npz``. The Python API keeps the same arrays in memory
(:class:`EmbeddingArrays`).

Memory stays bounded: each chunk's vectors go to an unnamed temporary file beside the output
as they come (``tempfile.TemporaryFile``: the system removes it, even after a kill); at the end
the ``.npy`` or ``.npz`` is assembled from it in an :class:`~graphormer_urpe.utils.files.AtomicFile`,
and the table and the embeddings are renamed onto their paths together
(:func:`~graphormer_urpe.utils.files.commit_together`): a failure (a full disk while the ``.npz`` is
assembled), Ctrl-C or a stop signal leaves every previous file as it was, never new vectors
beside an old table.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import zipfile
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import numpy as np

from graphormer_urpe.utils.files import AtomicFile, refuse_overwriting_inputs, written_in_place
from graphormer_urpe.prediction.model import ChunkOutput
from graphormer_urpe.prediction.table import InputRow

#: ``(option, suffix)`` of each embeddings output.
GRAPH_OPTION, ATOM_OPTION = ("--embeddings", ".npy"), ("--atom-embeddings", ".npz")


def check_embedding_paths(paths: dict[tuple[str, str], Path | None],
                          inputs: Sequence[tuple[str, str, Path | None]]) -> None:
    """One-line ``ValueError`` before any work for an embeddings output (``{(option, suffix):
    path}``) with another suffix, that is a directory or not a regular file, or that is one of
    ``inputs`` (``(option, what, path)``: the input, the checkpoints, the prediction table) or
    the other embeddings output."""
    given = [(option, path) for (option, _), path in paths.items() if path is not None]
    for (option, suffix), path in paths.items():
        if path is None:
            continue
        if path.is_dir():
            raise ValueError(f"{option} {path} is a directory; name the file to write")
        if path.suffix.lower() != suffix:
            raise ValueError(f"{option} {path}: the file must end in {suffix} (a NumPy "
                             f"{'array' if suffix == '.npy' else 'archive'})")
        if written_in_place(path):
            raise ValueError(f"{option} {path} is not a regular file")
        others = [(name, "embeddings output", other) for name, other in given if name != option]
        refuse_overwriting_inputs(option, [path], [*inputs, *others])


def row_vectors(rows: Sequence[InputRow], output: ChunkOutput) -> np.ndarray:
    """A chunk's molecule vectors, float32 ``[rows, D]``: NaN for its rows with an error."""
    vectors = output.embeddings.astype("<f4", copy=True)
    vectors[[bool(row.error) for row in rows]] = np.nan
    return vectors


def row_atoms(rows: Sequence[InputRow], output: ChunkOutput) -> list[np.ndarray | None]:
    """A chunk's atom vectors, float32 ``[atoms, D]`` per row: ``None`` for its rows with an error."""
    return [None if row.error or atoms is None else np.ascontiguousarray(atoms, dtype="<f4")
            for row, atoms in zip(rows, output.atoms)]


class EmbeddingArrays:
    """The embeddings of one prediction kept in memory, as :class:`EmbeddingFiles` writes them:
    :meth:`vectors` (``[rows, D]``, NaN for a row without prediction) and, with ``atoms``,
    :attr:`atoms` (each row's ``[atoms, D]``, ``None`` for a row without prediction)."""

    def __init__(self, atoms: bool = False) -> None:
        self._vectors: list[np.ndarray] = []
        self.atoms: list[np.ndarray | None] | None = [] if atoms else None

    def write(self, rows: Sequence[InputRow], output: ChunkOutput) -> None:
        self._vectors.append(row_vectors(rows, output))
        if self.atoms is not None:
            self.atoms.extend(row_atoms(rows, output))

    def vectors(self, width: int) -> np.ndarray:
        """``[rows, width]`` float32, in input order."""
        return np.concatenate(self._vectors) if self._vectors else np.zeros((0, width), np.float32)


def _write_npy(handle: IO[bytes], raw: IO[bytes], shape: tuple[int, int], dtype: str) -> None:
    """An ``.npy`` of ``shape`` to ``handle``: its header, then ``raw``'s bytes (C order)."""
    np.lib.format.write_array_header_1_0(handle, {"descr": np.dtype(dtype).str, "fortran_order": False,
                                                 "shape": shape})
    raw.seek(0)
    shutil.copyfileobj(raw, handle, 1 << 22)


class EmbeddingFiles:
    """The embeddings outputs of one prediction run (``graph``: the ``.npy``; ``atoms``: the
    ``.npz``; either may be None). Creating it checks that they can be written (``ValueError``
    naming the option); :meth:`write` takes each chunk in input order, :meth:`assemble` writes
    the files for the caller to put in place with the table; leaving the ``with`` block
    otherwise writes nothing."""

    def __init__(self, graph: Path | None, atoms: Path | None) -> None:
        self._outputs: dict[str, tuple[AtomicFile, IO[bytes]]] = {}
        self.rows = 0
        self._offsets = array("q", [0])
        try:
            for key, option, path in (("graph", GRAPH_OPTION[0], graph), ("atoms", ATOM_OPTION[0], atoms)):
                if path is None:
                    continue
                try:
                    output = AtomicFile(path, binary=True)
                except OSError as exc:
                    raise ValueError(f"{option} {path} cannot be written ({exc.strerror or exc})") from None
                self._outputs[key] = (output, tempfile.TemporaryFile(dir=Path(os.path.realpath(path)).parent))
        except BaseException:
            self.discard()
            raise

    def write(self, rows: Sequence[InputRow], output: ChunkOutput) -> None:
        """One chunk: NaN (no atoms) for its rows with an error, as the table leaves them empty."""
        self.rows += len(rows)
        if "graph" in self._outputs:
            self._outputs["graph"][1].write(row_vectors(rows, output).tobytes())
        if "atoms" in self._outputs:
            raw, end = self._outputs["atoms"][1], self._offsets[-1]
            for atoms in row_atoms(rows, output):
                if atoms is not None:
                    raw.write(atoms.tobytes())
                    end += len(atoms)
                self._offsets.append(end)

    def assemble(self, width: int, atom_width: int) -> list[AtomicFile]:
        """Write each file (``width``: a molecule's vector, ``atom_width``: an atom's) whole to its temporary beside its path; the returned
        files are put in place together with the table
        (:func:`~graphormer_urpe.utils.files.commit_together`), so that the vectors on disk are always
        those of the table's rows."""
        if "graph" in self._outputs:
            output, raw = self._outputs["graph"]
            _write_npy(output.handle, raw, (self.rows, width), "<f4")
        if "atoms" in self._outputs:
            output, raw = self._outputs["atoms"]
            offsets = np.frombuffer(self._offsets, dtype=np.int64)
            with zipfile.ZipFile(output.handle, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
                with archive.open("embeddings.npy", "w", force_zip64=True) as member:
                    _write_npy(member, raw, (int(offsets[-1]), atom_width), "<f4")
                with archive.open("offsets.npy", "w", force_zip64=True) as member:
                    np.lib.format.write_array(member, offsets)
        for _, raw in self._outputs.values():
            raw.close()
        return [output for output, _ in self._outputs.values()]

    def discard(self) -> None:
        for output, raw in self._outputs.values():
            raw.close()
            output.discard()

    def __enter__(self) -> EmbeddingFiles:
        return self

    def __exit__(self, *exc_info) -> None:
        self.discard()

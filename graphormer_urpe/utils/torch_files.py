"""The one way this package opens a torch file: as data only (``weights_only=True``), after its zip CRCs."""
from __future__ import annotations

import pickle
import zipfile
import zlib
from pathlib import Path

import torch

from graphormer_urpe.utils.files import unreadable_as_a_file


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable, damaged or not a graphormer-urpe model."""


def read_checkpoint(path: str | Path, map_location="cpu", *, what: str = "checkpoint"):
    """The torch file ``path`` (``what`` it is, for the messages) as plain data, never objects whose
    unpickling runs code; :class:`CheckpointError` naming it when it is missing, damaged or crafted."""
    path = Path(path)
    problem = unreadable_as_a_file(path)
    if problem:
        raise CheckpointError(f"{what} {path} {problem}")
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"{what} {path} cannot be read: not a PyTorch checkpoint archive "
                              "(truncated, damaged or another kind of file)")
    try:
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, zlib.error) as exc:
        raise CheckpointError(f"{what} {path} cannot be read: damaged archive ({exc})") from None
    if damaged is not None:
        raise CheckpointError(f"{what} {path} is damaged: its entry {damaged} fails the CRC check")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError:
        raise CheckpointError(f"{what} {path} cannot be read: it holds objects other than "
                              "tensors and plain values, which are never loaded") from None
    except Exception as exc:  # noqa: BLE001 - any failure of a verified archive is a bad file
        reason = str(exc).splitlines()[0] if str(exc) else ""
        raise CheckpointError(f"{what} {path} cannot be read ({type(exc).__name__}: {reason})") from None

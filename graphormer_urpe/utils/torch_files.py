"""Torch files read as data: :func:`read_checkpoint` is the one way this package opens a torch
file (a checkpoint, a model's weights, a saved training state): as data only
(``torch.load(weights_only=True)``: never code to run) after checking its zip CRCs; any failure
is a :class:`CheckpointError` naming the file. One is written as any file is (``torch.save``
into :func:`~graphormer_urpe.utils.files.atomic_write`). Building a model from a checkpoint is
:func:`graphormer_urpe.prediction.load.load_module` (training's Lightning module:
:func:`graphormer_urpe.training.module.load_training_module`), layers up.
"""
from __future__ import annotations

import pickle
import zipfile
from pathlib import Path

import torch

from graphormer_urpe.utils.files import unreadable_as_a_file


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable, damaged or not a graphormer-urpe model."""


def _verify_archive(ckpt: Path, what: str) -> None:
    import zlib

    if not zipfile.is_zipfile(ckpt):
        raise CheckpointError(f"{what} {ckpt} cannot be read: not a PyTorch checkpoint archive "
                              "(truncated, damaged or another kind of file)")
    try:
        with zipfile.ZipFile(ckpt) as archive:
            damaged = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, zlib.error) as exc:
        raise CheckpointError(f"{what} {ckpt} cannot be read: damaged archive ({exc})") from None
    if damaged is not None:
        raise CheckpointError(f"{what} {ckpt} is damaged: its entry {damaged} fails the CRC check")


def read_checkpoint(path: str | Path, map_location="cpu", *, what: str = "checkpoint"):
    """The content of the torch file ``path`` (``what`` it is, for the messages), read as plain
    data: tensors, numbers, strings and containers of them, never objects whose unpickling runs
    code. :class:`CheckpointError` naming the file when it is missing, a damaged archive (zip
    CRCs), or holds anything else (a crafted file refused here has not run anything)."""
    path = Path(path)
    problem = unreadable_as_a_file(path)
    if problem:
        raise CheckpointError(f"{what} {path} {problem}")
    _verify_archive(path, what)
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError:
        raise CheckpointError(f"{what} {path} cannot be read: it holds objects other than "
                              "tensors and plain values, which are never loaded") from None
    except Exception as exc:  # noqa: BLE001 - any failure of a verified archive is a bad file
        reason = str(exc).splitlines()[0] if str(exc) else ""
        raise CheckpointError(f"{what} {path} cannot be read ({type(exc).__name__}: {reason})") from None

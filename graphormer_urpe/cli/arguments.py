"""Argument types shared by the console scripts (``argparse`` ``type=``): a bad value is a usage
error naming the option, exit status 2; the refusal of an output that is an input."""
from __future__ import annotations

import argparse
import os
import re
from collections.abc import Iterable

from graphormer_urpe.utils.files import same_file


def refuse_overwriting_inputs(option: str, outputs: Iterable[str | os.PathLike],
                              inputs: Iterable[tuple[str, str, str | os.PathLike | None]]) -> None:
    """One-line ``ValueError`` when an output file (of ``option``) is a file the command reads:
    ``inputs`` are ``(its option, what it is, path)`` (a None path is skipped), compared however
    spelled (:func:`same_file`: ``sub/../x``, a symbolic or hard link). Checked before any work:
    writing the output would destroy the input."""
    inputs = [(name, what, path) for name, what, path in inputs if path is not None]
    for output in outputs:
        for name, what, path in inputs:
            if same_file(path, output):
                raise ValueError(f"{option} {output} is the {what} {path} ({name}): it would be "
                                 "overwritten; choose another output")


def positive_int(text: str) -> int:
    """An integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def duration(text: str) -> float:
    """Seconds in ``540``, ``540s``, ``9m``, ``1h30m`` (> 0)."""
    match = re.fullmatch(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s?)?", text.strip())
    if not text.strip() or match is None:
        raise argparse.ArgumentTypeError(f"expected a duration such as 540, 540s, 9m or 1h30m, got {text!r}")
    hours, minutes, seconds = (float(g) if g else 0.0 for g in match.groups())
    total = 3600 * hours + 60 * minutes + seconds
    if total <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive duration, got {text!r}")
    return total


def folder_name_problem(option: str, name: str, parent: str) -> str | None:
    """Why ``name``, given as ``option``, cannot name a folder inside ``parent`` (an option
    naming a directory), in one line; None when it can: letters, digits, '.', '_' and '-', not
    '.' or '..' (a path, such as ``../x`` or ``/abs``, would put the folder elsewhere)."""
    if re.fullmatch(r"[\w.-]+", name) and name not in (".", ".."):
        return None
    return (f"{option} must be a plain name (letters, digits, '.', '_', '-'; not '.' or '..': "
            f"it is a folder in {parent}), got {name!r}")

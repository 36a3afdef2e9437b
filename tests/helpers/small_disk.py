"""A real file system of a few hundred kilobytes, for tests of what a command does when the disk
fills: a tmpfs mounted for the test (root only; the test is skipped where it cannot be mounted)."""
from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

PAGE = 4096


@contextlib.contextmanager
def small_disk(where: Path, size: int) -> Iterator[Path]:
    """``where`` (created) holds a file system of ``size`` bytes (rounded up to whole pages; each
    file takes whole pages) for the block; unmounted after it."""
    where.mkdir(parents=True, exist_ok=True)
    size = -(-size // PAGE) * PAGE
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0777", "tmpfs", str(where)],
                              capture_output=True, text=True)
        why = done.stderr.strip() if done.returncode else None
    except OSError as exc:  # no mount command
        why = str(exc)
    if why is not None:
        pytest.skip(f"a small file system cannot be mounted here (mount -t tmpfs: {why})")
    try:
        yield where
    finally:
        subprocess.run(["umount", "--lazy", str(where)], check=True)


def pages(size: int) -> int:
    """The bytes a file of ``size`` bytes takes on the small disk."""
    return max(-(-size // PAGE), 1) * PAGE

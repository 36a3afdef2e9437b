"""A command run with some paths read-only, as a read-only folder or file system is to it."""
from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest


def read_only(paths: list[Path], command: list[str]) -> list[str]:
    """``command`` run with ``paths`` read-only: for root (whom file modes do not stop) each is a
    read-only bind mount in the command's own mount namespace; for others, its write bits go."""
    if os.geteuid() != 0:
        for path in paths:
            path.chmod(0o555 if path.is_dir() else 0o444)
        return command
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"root cannot make a read-only mount here (unshare -m: {probe.stderr.decode().strip()})")
    mounts = " && ".join(f"mount --bind {shlex.quote(str(p))} {shlex.quote(str(p))} && "
                         f"mount -o remount,bind,ro {shlex.quote(str(p))}" for p in paths)
    return ["unshare", "-m", "sh", "-c", f'{mounts} && exec "$@"', "sh", *command]


@pytest.fixture
def writable_again(tmp_path):
    """After the test, every file and folder in ``tmp_path`` writable again (:func:`read_only`
    takes the write bits where the test runs as another user than root)."""
    yield
    for path in tmp_path.rglob("*"):
        if not path.is_symlink():
            path.chmod(0o755 if path.is_dir() else 0o644)

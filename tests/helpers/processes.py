"""A command's processes as Linux's ``/proc`` shows them, for the tests of its workers and stops."""
from __future__ import annotations

import os
import time
from pathlib import Path


def children(pid: int) -> list[int]:
    """The child processes of ``pid`` (of all its threads); none once it has ended."""
    try:
        return [int(child) for task in os.listdir(f"/proc/{pid}/task")
                for child in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    except OSError:
        return []


def group_is_gone(pgid: int) -> bool:
    """No process of the group is left (its workers included), within a few seconds."""
    for _ in range(100):
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False

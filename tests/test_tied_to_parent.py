"""A study's child (a trial's or a run's ``fit``) ends with the study that started it, killed or
not (:func:`graphormer_urpe.training.studies.study.tied_to_parent`, Linux)."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
#: A stand-in for a study: starts a child tied to it, prints the child's pid, then waits.
PARENT = """
import signal, subprocess, sys, time
from graphormer_urpe.training.studies.study import tied_to_parent
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                         preexec_fn=tied_to_parent(getattr(signal, sys.argv[1])))
print(child.pid, flush=True)
time.sleep(120)
"""


def ended(pid: int) -> bool:
    """The process is gone or a zombie (it ended; nobody reaped it) within ten seconds."""
    for _ in range(200):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("signum", ["SIGTERM", "SIGKILL"])
def test_a_child_ends_when_the_study_that_started_it_is_killed(signum):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, signum], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    child = int(parent.stdout.readline())
    try:
        assert Path(f"/proc/{child}").exists()  # it runs while its parent does
        parent.kill()  # SIGKILL: the parent runs no handler of its own
        parent.wait()
        assert ended(child), f"the child of a killed parent is still running ({signum})"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)

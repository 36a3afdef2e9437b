"""The processes a command forks (its workers), counted exactly: an audit hook (``os.fork``, which
``multiprocessing`` calls to start each worker) installed in the command's interpreter by a
``sitecustomize`` module on its ``PYTHONPATH``, writing one line per fork."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

_SITECUSTOMIZE = '''\
import os
import sys


def _count_forks(event, args):
    if event == "os.fork":
        with open(os.environ["FORKS_LOG"], "a") as log:
            log.write(f"{os.getpid()}\\n")


sys.addaudithook(_count_forks)
'''


def run_counting_forks(command: list, folder: Path, **kwargs) -> tuple[subprocess.CompletedProcess, int]:
    """``command`` run to its end (text output captured) and the number of processes it forked,
    its workers' forks included; the hook and its log live in ``folder``."""
    hook = folder / "fork_hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    log = folder / "forks.log"
    log.unlink(missing_ok=True)
    env = kwargs.pop("env", os.environ)
    path = os.pathsep.join(p for p in (str(hook), env.get("PYTHONPATH")) if p)
    done = subprocess.run([str(c) for c in command], capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          timeout=600, env={**env, "PYTHONPATH": path, "FORKS_LOG": str(log)}, **kwargs)
    return done, len(log.read_text().split()) if log.exists() else 0

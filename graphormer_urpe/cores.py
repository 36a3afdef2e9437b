"""How many CPU cores this process may use, and pools of worker processes over them."""
from __future__ import annotations

import multiprocessing
import multiprocessing.pool
import os
from collections.abc import Callable


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity where the platform reports one (a
    container or ``taskset`` limit), else every core of the machine; at least 1."""
    if hasattr(os, "sched_getaffinity"):
        return max(len(os.sched_getaffinity(0)), 1)
    return os.cpu_count() or 1


def process_pool(workers: int, initializer: Callable | None = None,
                 initargs: tuple = ()) -> multiprocessing.pool.Pool:
    """A pool of ``workers`` processes, forked where the platform can (a worker starts in
    milliseconds, with what this process has imported and loaded), else spawned."""
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    return multiprocessing.get_context(method).Pool(workers, initializer, initargs)

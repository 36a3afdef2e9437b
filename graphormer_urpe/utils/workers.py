"""Worker processes for the data builds and the prediction, each with a pipe of its own to the parent.

Not ``concurrent.futures`` (nor loky, nor ``multiprocessing.Pool``): their workers share one result
pipe, so a worker killed while it writes a result (the out-of-memory killer) leaves the parent
waiting for ever (``tests/test_workers.py``); here its death ends its own pipe, and the work ends in
one :class:`WorkerDied`. Workers ignore the stop signals: the parent kills and reaps them.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import signal
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from graphormer_urpe.utils.process import hold_stop_signals, leave_stop_signals_to_parent, usable_cores

#: Seconds a worker may take to leave after its last job before it is killed.
_LEAVE_SECONDS = 10
#: What torch's CPU allocator and oneDNN say of a failed allocation (they raise no ``MemoryError``).
_OUT_OF_MEMORY_MESSAGES = ("can't allocate memory", "not enough memory", "could not create a primitive")


def useful_workers(asked: int | None, jobs: int | None = None) -> int:
    """Workers worth starting for ``asked`` (None: one per core): at most the usable cores and the ``jobs``."""
    count = usable_cores() if asked is None else min(int(asked), usable_cores())
    return count if jobs is None else min(count, int(jobs))


def ran_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocation that failed (``MemoryError``, torch's ``OutOfMemoryError``, or a
    ``RuntimeError`` saying so)."""
    torch = sys.modules.get("torch")  # not imported for it: an error of torch's means it is loaded
    if isinstance(error, MemoryError) or (torch is not None and isinstance(error, torch.OutOfMemoryError)):
        return True
    return isinstance(error, RuntimeError) and any(text in str(error) for text in _OUT_OF_MEMORY_MESSAGES)


class WorkerDied(RuntimeError):
    """A worker process ended without returning its job's result."""


def exit_status(code: int | None) -> str:
    """A process's exit code in words: ``-9 (killed by SIGKILL)``."""
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"{code} (killed by {signal.Signals(-code).name})"
    return str(code)


def _serve(connection, inherited: list, function: Callable, initializer: Callable | None, initargs: tuple) -> None:
    """A worker: ``function(job)``'s result (or exception) for each job, until the pipe closes or a ``None`` job."""
    leave_stop_signals_to_parent()
    for other in inherited:  # the parent's ends of the pipes, so that its death closes them
        other.close()
    if initializer is not None:
        initializer(*initargs)
    with contextlib.suppress(EOFError, OSError):  # the pipe closed: the parent is done or gone
        while (job := connection.recv()) is not None:
            try:
                reply = (True, function(job))
            except Exception as exc:  # returned to the parent, which raises it
                reply = (False, exc)
            try:
                connection.send(reply)
            except (TypeError, AttributeError, ValueError, RuntimeError):  # not picklable
                if reply[0]:
                    raise
                connection.send((False, RuntimeError("".join(traceback.format_exception(reply[1])))))


class WorkerProcesses:
    """``workers`` processes computing ``function(job)`` (after ``initializer(*initargs)``), forked where
    possible; gone when the ``with`` block ends (killed if it ends by an exception or a signal)."""

    def __init__(self, workers: int, function: Callable, initializer: Callable | None = None,
                 initargs: tuple = ()) -> None:
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        context = multiprocessing.get_context(method)
        self._processes: list = []
        self._connections: list = []
        with hold_stop_signals():  # a signal now is taken once every worker ignores it
            try:
                for _ in range(workers):
                    ours, theirs = context.Pipe()
                    self._connections.append(ours)
                    inherited = list(self._connections) if method == "fork" else []
                    process = context.Process(target=_serve, daemon=True,
                                              args=(theirs, inherited, function, initializer, initargs))
                    process.start()
                    theirs.close()
                    self._processes.append(process)
            except BaseException:
                self._stop(kill=True)
                raise

    @property
    def workers(self) -> int:
        return len(self._processes)

    def imap(self, jobs: Iterable[tuple[Any, Any]], ahead: int) -> Iterator[tuple[Any, Any]]:
        """``(key, function(job))`` for each ``(key, job)``, in order, at most ``ahead`` jobs in flight; a
        job's exception is raised here. Left before its end, it kills the workers."""
        jobs, idle = iter(jobs), list(range(len(self._processes)))[::-1]
        busy: dict[int, int] = {}  # worker -> the number of the job it holds
        keys: dict[int, Any] = {}
        done: dict[int, Any] = {}
        taken = given = 0
        try:
            while True:
                while idle and taken - given < ahead and (item := next(jobs, None)) is not None:
                    worker = idle.pop()
                    keys[taken], job = item
                    try:
                        self._connections[worker].send(job)
                    except OSError:  # its end of the pipe is closed: it died
                        raise self._died(worker) from None
                    busy[worker] = taken
                    taken += 1
                if given in done:
                    yield keys.pop(given), done.pop(given)
                    given += 1
                    continue
                if not busy:
                    return
                by_connection = {self._connections[w]: w for w in busy}
                for connection in multiprocessing.connection.wait(list(by_connection)):
                    worker = by_connection[connection]
                    try:
                        ok, value = connection.recv()
                    except (EOFError, OSError):
                        raise self._died(worker) from None
                    if not ok:
                        raise value
                    done[busy.pop(worker)] = value
                    idle.append(worker)
        except BaseException:
            self._stop(kill=True)
            raise

    def _died(self, worker: int) -> WorkerDied:
        process = self._processes[worker]
        process.join(_LEAVE_SECONDS)
        return WorkerDied(f"a worker process (pid {process.pid}) ended with exit status "
                          f"{exit_status(process.exitcode)} before returning its chunk (out of memory?)")

    def _stop(self, kill: bool) -> None:
        with hold_stop_signals():
            for connection in self._connections:
                if not kill:
                    with contextlib.suppress(OSError):
                        connection.send(None)
                connection.close()
            for process in self._processes:
                if kill:
                    process.kill()
            for process in self._processes:
                process.join(None if kill else _LEAVE_SECONDS)
                if process.exitcode is None:
                    process.kill()
                    process.join()
            self._processes, self._connections = [], []

    def __enter__(self) -> WorkerProcesses:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._stop(kill=exc_type is not None)

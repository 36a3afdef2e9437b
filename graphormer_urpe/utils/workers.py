"""Worker processes, each with a pipe of its own, so that stopping them never waits for ever: the
data builds' featurizers (:func:`~graphormer_urpe.data.featurize.parallel_map`) and the
prediction's (:func:`~graphormer_urpe.prediction.run.stream`).

``concurrent.futures.ProcessPoolExecutor``, loky and ``multiprocessing.Pool`` share one result
pipe among the workers and the parent: a worker killed while it writes a result (the
out-of-memory killer, a SIGTERM to the process group) leaves the parent reading the rest of it
for ever (``tests/test_workers.py``), and the pool re-forks a worker that ends. Here the parent
writes each job to one worker's pipe and reads its result from the same pipe, whose other end
that worker alone holds: its death ends the pipe, and the work ends with one :class:`WorkerDied`
naming its exit status. A worker gets a job only once it has returned its previous one, so
neither side ever waits for the other to read.

Workers ignore SIGINT, SIGTERM and SIGHUP: a stop signal to the process group reaches the parent,
which kills them (they hold nothing another process waits for) and waits for them, with those
signals held back meanwhile, so that no worker is left running; a worker whose parent was killed
finds its pipe closed at its next job and ends. :func:`useful_workers` is how many to start: no
more than the usable cores nor than the jobs; :func:`ran_out_of_memory` tells a job's (or this
process's) out-of-memory error from the others, which a command then names in one line.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import signal
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from graphormer_urpe.utils.process import hold_stop_signals, leave_stop_signals_to_parent, usable_cores

#: Seconds a worker may take to leave after its last job before it is killed.
_LEAVE_SECONDS = 10

K = TypeVar("K")


def useful_workers(asked: int | None, jobs: int | None = None) -> int:
    """The worker processes worth starting for ``asked`` (None: one per usable core): at most
    the cores this process may use (:func:`~graphormer_urpe.utils.process.usable_cores`; more
    only take turns on them, each with its own memory) and, where the number of ``jobs`` is
    known, at most one per job."""
    cores = usable_cores()
    count = cores if asked is None else min(int(asked), cores)
    return count if jobs is None else min(count, int(jobs))


#: What an allocation that failed says where it raises no ``MemoryError``: torch's CPU allocator
#: (``DefaultCPUAllocator: can't allocate memory``, ``not enough memory``) and oneDNN, whose
#: kernels cannot be created where no memory is left (``could not create a primitive``).
_OUT_OF_MEMORY_MESSAGES = ("can't allocate memory", "not enough memory", "could not create a primitive")


def ran_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocation that failed: a ``MemoryError`` (Python, numpy), torch's
    ``OutOfMemoryError`` (a device's memory) or a ``RuntimeError`` of torch's or oneDNN's saying
    so (an address-space limit, ``ulimit -v``, or a full machine)."""
    torch = sys.modules.get("torch")  # not imported for it: an error of torch's means it is loaded
    if isinstance(error, MemoryError) or (torch is not None and isinstance(error, torch.OutOfMemoryError)):
        return True
    return isinstance(error, RuntimeError) and any(text in str(error) for text in _OUT_OF_MEMORY_MESSAGES)


class WorkerDied(RuntimeError):
    """A worker process ended without returning its job's result."""


def _serve(connection, inherited: list, function: Callable, initializer: Callable | None,
           initargs: tuple) -> None:
    """A worker: ``function(job)`` for each job read from ``connection``, its result (or the
    exception it raised) written back, until the pipe closes or a ``None`` job comes."""
    leave_stop_signals_to_parent()
    for other in inherited:  # the parent's ends of the pipes, so that its death closes them
        other.close()
    if initializer is not None:
        initializer(*initargs)
    while True:
        try:
            job = connection.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        try:
            reply = (True, function(job))
        except Exception as exc:  # returned to the parent, which raises it
            reply = (False, exc)
        try:
            try:
                connection.send(reply)
            except (TypeError, AttributeError, ValueError, RuntimeError):  # not picklable
                if reply[0]:
                    raise
                connection.send((False, RuntimeError("".join(traceback.format_exception(reply[1])))))
        except (BrokenPipeError, EOFError, OSError):  # the parent is gone
            return


class WorkerProcesses:
    """``workers`` processes computing ``function(job)`` (after ``initializer(*initargs)``),
    forked where the platform can, else spawned. Use it as a ``with`` block: leaving the block
    normally lets the workers end; leaving it by an exception or a signal kills them. Either way
    they are gone when the block has ended."""

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
        """The number of worker processes."""
        return len(self._processes)

    def imap(self, jobs: Iterable[tuple[K, Any]], ahead: int) -> Iterator[tuple[K, Any]]:
        """``(key, function(job))`` for each ``(key, job)`` of ``jobs``, in their order; at most
        ``ahead`` jobs are taken from ``jobs`` and not yet given back. A job's exception is
        raised here; a worker that died raises :class:`WorkerDied`. Left before its end (an
        exception, a ``break``), it kills the workers: their pipes may hold results of its jobs."""
        try:
            yield from self._imap(jobs, ahead)
        except BaseException:
            self._stop(kill=True)
            raise

    def _imap(self, jobs: Iterable[tuple[K, Any]], ahead: int) -> Iterator[tuple[K, Any]]:
        jobs = iter(jobs)
        idle = list(range(len(self._processes)))[::-1]
        busy: dict[int, int] = {}  # worker -> the number of the job it holds
        keys: dict[int, Any] = {}
        done: dict[int, Any] = {}
        taken = given = 0
        more = True
        while True:
            while more and idle and taken - given < ahead:
                try:
                    key, job = next(jobs)
                except StopIteration:
                    more = False
                    break
                worker = idle.pop()
                try:
                    self._connections[worker].send(job)
                except OSError:  # its end of the pipe is closed: it died
                    raise self._died(worker) from None
                busy[worker], keys[taken] = taken, key
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


def exit_status(code: int | None) -> str:
    """A process's exit code (``multiprocessing``'s, ``subprocess``'s) in words: ``-9`` is killed by SIGKILL."""
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"{code} (killed by {signal.Signals(-code).name})"
    return str(code)

"""The command's process: the CPU cores it may use, and how every command stops (:func:`run_command`)."""
from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator

#: Signals that stop a command like Ctrl-C: ``kill``, a closed terminal or SSH session.
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
#: Exit status of a command stopped by Ctrl-C, as a shell reports it.
INTERRUPTED = 128 + signal.SIGINT


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: a container or ``taskset`` limit); at least 1."""
    if hasattr(os, "sched_getaffinity"):
        return max(len(os.sched_getaffinity(0)), 1)
    return os.cpu_count() or 1


class StoppedBySignal(SystemExit):
    """A stop signal, raised by :func:`stop_on_signals`: exit status 128 + ``signum``."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


def replaceable(signum: int) -> bool:
    """Whether a handler may be put on ``signum`` and the present one given back: not one the
    command was started to ignore (``nohup``), nor one installed from C (``getsignal`` gives None)."""
    return signal.getsignal(signum) not in (signal.SIG_IGN, None)


@contextlib.contextmanager
def stop_on_signals(unless_handled: bool = False) -> Iterator[None]:
    """Within the block (main thread only) SIGTERM and SIGHUP raise :class:`StoppedBySignal`, so
    that ``finally`` blocks remove temporaries; ``unless_handled``: a handler already there (a
    runner's own) is left to it."""
    def stop(signum, frame):
        raise StoppedBySignal(signum)

    previous = {} if threading.current_thread() is not threading.main_thread() else {
        signum: signal.signal(signum, stop) for signum in _STOP_SIGNALS
        if signal.getsignal(signum) == signal.SIG_DFL or (replaceable(signum) and not unless_handled)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def hold_stop_signals() -> Iterator[None]:
    """Ctrl-C, SIGTERM and SIGHUP wait until the block ends (renames that go together, reaping workers)."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, *_STOP_SIGNALS))
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def leave_stop_signals_to_parent() -> None:
    """In a worker process: the stop signals ignored (no longer held), so that its parent stops it."""
    for signum in (signal.SIGINT, *_STOP_SIGNALS):
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGINT, *_STOP_SIGNALS))


def run_command(prog: str, work: Callable[[], int], *, signals: bool = True,
                left: str = "outputs not yet written are left as they were") -> int:
    """``work()``'s exit status; a stop is one line on stderr ending with ``left`` instead of a
    traceback: SIGTERM and SIGHUP 128 + the signal, Ctrl-C (also the ``sys.exit(1)`` Lightning's
    loops make of it) 130, a full disk 1. ``signals``: False where the work takes the stop
    signals itself (a fit stops at the end of its step)."""
    try:
        with stop_on_signals() if signals else contextlib.nullcontext():
            return work()
    except StoppedBySignal as stop:
        print(f"{prog}: stopped by {signal.Signals(stop.signum).name}; {left}", file=sys.stderr)
        return stop.code
    except (KeyboardInterrupt, SystemExit) as exc:
        if isinstance(exc, SystemExit) and not (exc.code == 1 and isinstance(exc.__context__, KeyboardInterrupt)
                                                and not exc.__suppress_context__):
            raise
        print(f"{prog}: stopped by Ctrl-C (SIGINT); {left}", file=sys.stderr)
        return INTERRUPTED
    except Exception as exc:
        full = disk_full(exc)
        if full is None:
            raise
        print(f"{prog}: error: {full}; {left}", file=sys.stderr)
        return 1


def causes(error: BaseException) -> Iterator[BaseException]:
    """``error``, then the error it was raised from or while handling, and so on."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def disk_full(error: BaseException) -> OSError | None:
    """The full disk (or exhausted quota) behind ``error`` (torch's writer raises a ``RuntimeError`` over it)."""
    return next((cause for cause in causes(error)
                 if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT)), None)

"""The command's process: how many CPU cores it may use (its workers: :mod:`.workers`);
stopping on signals (:func:`run_command`: Ctrl-C, SIGTERM, a full disk as one line and an
exit status)."""
from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity where the platform reports one (a
    container or ``taskset`` limit), else every core of the machine; at least 1."""
    if hasattr(os, "sched_getaffinity"):
        return max(len(os.sched_getaffinity(0)), 1)
    return os.cpu_count() or 1


#: Signals that stop a command like Ctrl-C: ``kill``, a closed terminal or SSH session.
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class StoppedBySignal(SystemExit):
    """Raised by :func:`stop_on_signals`: exit status 128 + ``signum``."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


def replaceable(signum: int) -> bool:
    """Whether a handler may be put on ``signum`` and the present one given back later: not when
    the command was started to ignore it (``nohup``), nor when its handler was installed from C
    (``signal.getsignal`` gives None, which cannot be given back)."""
    return signal.getsignal(signum) not in (signal.SIG_IGN, None)


@contextlib.contextmanager
def stop_on_signals(unless_handled: bool = False) -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise :class:`StoppedBySignal` (a ``SystemExit``,
    status 128 + the signal) in the main thread, so ``finally`` blocks and ``with`` exits run
    (temporary files are removed) instead of the process dying on the spot; the previous
    handlers are restored on exit. A signal the command was started to ignore (``nohup``) stays
    ignored, one whose handler was installed from C is left to it; ``unless_handled``: one that
    already has a handler (a runner's own) is left to it."""
    def stop(signum, frame):
        raise StoppedBySignal(signum)

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def taken(signum: int) -> bool:
        return signal.getsignal(signum) == signal.SIG_DFL or (replaceable(signum) and not unless_handled)

    previous = {signum: signal.signal(signum, stop) for signum in _STOP_SIGNALS if taken(signum)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def hold_stop_signals() -> Iterator[None]:
    """Within the block Ctrl-C, SIGTERM and SIGHUP wait, and are delivered when it ends: for
    steps that must not be cut in the middle (renames that go together, reaping child
    processes)."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, *_STOP_SIGNALS))
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def leave_stop_signals_to_parent() -> None:
    """In a worker process: Ctrl-C, SIGTERM and SIGHUP ignored (and no longer held, as its
    parent held them while it started it): its parent takes them, and stops its workers."""
    for signum in (signal.SIGINT, *_STOP_SIGNALS):
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGINT, *_STOP_SIGNALS))


#: ``errno`` of a full disk or an exhausted quota: a command says so in one line, exit status 1.
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
#: Exit status of a command stopped by Ctrl-C (SIGINT), as a shell reports it: 128 + 2.
INTERRUPTED = 128 + signal.SIGINT


#: What a stopped command's line says of its outputs, unless the command says more.
OUTPUTS_LEFT = "outputs not yet written are left as they were"


def run_command(prog: str, work: Callable[[], int], *, left: str = OUTPUTS_LEFT, signals: bool = True) -> int:
    """``work()``'s exit status, with the endings every command shares said in one line on stderr
    (ending with ``left``, what the ending left of the outputs) instead of a traceback: SIGTERM
    and SIGHUP exit with 128 + the signal (143, 129), Ctrl-C (``KeyboardInterrupt``, also the
    ``sys.exit(1)`` Lightning's loops make of it) with 130, a full disk (:func:`disk_full`)
    with 1. ``signals``: the stop signals raise :class:`StoppedBySignal` within ``work``
    (:func:`stop_on_signals`); False where the work takes them itself (a fit's trainer stops
    at the end of its step). The files a command writes are put in place whole (:mod:`.files`),
    so each ending leaves each output whole: the new content, or the previous."""
    try:
        with stop_on_signals() if signals else contextlib.nullcontext():
            return work()
    except StoppedBySignal as stop:
        print(f"{prog}: stopped by {signal.Signals(stop.signum).name}; {left}", file=sys.stderr)
        return stop.code
    except (KeyboardInterrupt, SystemExit) as exc:
        # Lightning's loops make Ctrl-C sys.exit(1); any other exit is a status the work chose
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
    """The full disk (:data:`DISK_FULL`) that ``error`` is, or was raised while handling: torch's
    writer reports one as a ``RuntimeError`` (``unexpected pos``) raised over the ``OSError``."""
    return next((cause for cause in causes(error) if isinstance(cause, OSError) and cause.errno in DISK_FULL), None)

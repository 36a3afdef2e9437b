"""The worker processes of the data builds and the prediction
(:class:`graphormer_urpe.utils.workers.WorkerProcesses`): a worker killed while it writes its
result back is one error naming it, at once, with no process left.

This is what ``concurrent.futures.ProcessPoolExecutor`` cannot give (the last test): its workers
share one result pipe, so a worker killed in the middle of a result leaves the parent reading the
rest of it for ever. Here each worker has a pipe of its own, whose end the parent alone holds: its
death is the end of that pipe."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from helpers.processes import group_is_gone

REPO = Path(__file__).resolve().parents[1]

#: A job that returns 64 MiB and is killed (SIGKILL, as the out-of-memory killer does) once the
#: result is being written to the parent: a thread of the worker watches for the write.
_KILLED_WHILE_IT_RETURNS = textwrap.dedent("""
    import os, signal, sys, threading, time
    from graphormer_urpe.utils.workers import WorkerDied, WorkerProcesses

    def returns_then_dies(megabytes):
        main = threading.main_thread()

        def watch():
            while True:
                frame = sys._current_frames().get(main.ident)
                while frame is not None:
                    if frame.f_code.co_name == "_send_bytes":
                        os.kill(os.getpid(), signal.SIGKILL)
                    frame = frame.f_back
                time.sleep(0.0005)

        threading.Thread(target=watch, daemon=True).start()
        return b"x" * (megabytes << 20)

    if __name__ == "__main__":
        started = time.monotonic()
        if sys.argv[1:] == ["executor"]:
            from concurrent.futures import ProcessPoolExecutor

            with ProcessPoolExecutor(2) as executor:
                list(executor.map(returns_then_dies, [64] * 4))
        try:
            with WorkerProcesses(2, returns_then_dies) as workers:
                list(workers.imap(((job, 64) for job in range(4)), ahead=4))
        except WorkerDied as died:
            print(died)
        print(f"{time.monotonic() - started:.1f}")
""")


def _killed_while_it_returns(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _KILLED_WHILE_IT_RETURNS, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})


def test_a_worker_killed_while_it_writes_its_result_is_one_error_at_once():
    """Two workers, each killed while it writes a 64 MiB result back: the work ends with one
    :class:`~graphormer_urpe.utils.workers.WorkerDied` naming a worker's pid and SIGKILL, within
    seconds, and no process of it is left."""
    process = _killed_while_it_returns()
    try:
        out, err = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise AssertionError("the parent still waited for the killed worker's result after 120 s") from None
    assert process.returncode == 0, err[-3000:]
    died, seconds = out.strip().splitlines()
    assert died.startswith("a worker process (pid ") and died.endswith(
        "ended with exit status -9 (killed by SIGKILL) before returning its chunk (out of memory?)"), died
    assert float(seconds) < 30
    assert group_is_gone(process.pid), "a worker process outlived the work"


def test_an_executor_whose_worker_is_killed_while_it_writes_its_result_waits_for_ever():
    """The same job on ``concurrent.futures.ProcessPoolExecutor``: the parent still waits for the
    rest of the killed worker's result 30 s later (the reason ``utils/workers.py`` exists; should
    this fail, the executor would do)."""
    process = _killed_while_it_returns("executor")
    try:
        out, err = process.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        return
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    raise AssertionError(f"the executor ended (status {process.returncode}): {out[-1000:]}{err[-2000:]}")

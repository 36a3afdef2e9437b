"""Files that appear whole or not at all, the checks of paths given as inputs and outputs, and
the lock that gives a folder to one process.

A file is put in place one way: :func:`atomic_write` (its :class:`AtomicFile` where the commit
is decided later, or a writer takes a path); several files that go together by
:func:`commit_together`; a folder by :class:`AtomicDirectory`.

A file is written to a temporary sibling (``.<name>.<random>.part``), flushed to disk (fsync)
and renamed onto its path with ``os.replace``, which is atomic within one file system: a reader,
a crash or a kill sees the previous content or the new, never half of it. A folder is built the
same way (``.<name>.tmp-<random>``). The temporary is removed on every other exit (an exception,
a full disk, ``SystemExit`` from
:func:`graphormer_urpe.utils.process.stop_on_signals`); a folder's temporary that a killed build
(``SIGKILL``) left is removed by the next build of that folder.

Every lock is the ``filelock`` package's (``flock`` on a lock file), which the kernel drops when
the process ends, killed or not.
"""
from __future__ import annotations

import contextlib
import glob
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

import filelock

from graphormer_urpe.utils.process import hold_stop_signals

def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether ``a`` and ``b`` name one file: ``os.path.samefile`` when both exist (symbolic and
    hard links included), else their resolved paths are equal."""
    if os.path.exists(a) and os.path.exists(b):
        return os.path.samefile(a, b)
    return Path(a).resolve() == Path(b).resolve()


def check_writable_dir(directory: str | os.PathLike, option: str) -> None:
    """One-line ``ValueError`` naming ``option`` unless a file can be created in ``directory``
    (created if missing; a read-only or full file system, a path through a file): checked before
    the long work whose results go there."""
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        raise ValueError(f"{option} {directory} cannot be written ({exc.strerror or exc})") from None


def check_creatable_dir(path: Path, option: str) -> None:
    """One-line ``ValueError`` naming ``option`` unless ``path`` is a directory, or can be made
    as one, that can be written (checked without creating anything)."""
    existing = Path(path).absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{option} {path} cannot be written ({existing} is not a directory)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{option} {path} cannot be written ({existing} is read-only)")


def unreadable_as_a_file(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot be read as an input file, in words that follow its name (``"does not
    exist"``, ``"is a directory"``, ``"is a FIFO (named pipe), not a regular file"``, ...), or
    None for a regular file. Inputs are read more than once (a header, then the rows), which a
    pipe, a terminal or standard input cannot give."""
    if str(path) == "-":
        return "is '-', but standard input is not read: give a file"
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "does not exist" + (" (a symbolic link to a missing file)" if os.path.islink(path) else "")
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "is a directory"
    for is_kind, kind in ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if is_kind(mode):
            return f"is {kind}, not a regular file"
    return "is not a regular file"


#: Names of a process's open files (``/dev/stdout`` is whatever standard output is: a pipe, a
#: terminal, a file the shell opened): written through the open file, never replaced.
_OPEN_FILE_NAMES = ("/dev/stdout", "/dev/stderr", "/dev/fd/", "/proc/")


def written_in_place(path: str | os.PathLike) -> bool:
    """Whether ``path`` is written where it stands rather than replaced by a rename: an existing
    file that is not a regular one (a device such as ``/dev/null``, a FIFO, a socket) or a name
    of an open file (:data:`_OPEN_FILE_NAMES`). Renaming a file onto those would replace the
    device, pipe or file the user named instead of writing to it."""
    absolute = Path(path).absolute()
    return (absolute.exists() and not absolute.is_file()) or str(absolute).startswith(_OPEN_FILE_NAMES)


def _fsync(path: str | os.PathLike) -> None:
    """Flush a file, or a folder's entries (a rename into it), to disk where the platform can."""
    with contextlib.suppress(OSError):  # a folder cannot be opened on every platform
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class AtomicFile:
    """The one way a file is put in place: written beside ``path`` and moved onto it by
    :meth:`commit` (several outputs of one run together: :func:`commit_together`); removed by
    :meth:`discard` or on leaving the ``with`` block without a commit. Creating it checks that
    ``path`` can be written. ``handle``: the open temporary (text with ``newline=""`` and UTF-8,
    or binary); ``temporary``: its path, for a writer that takes a path (Lightning's checkpoint
    I/O), None for a file written in place.

    A symbolic link is written through: its target gets the content (created if missing) and the
    link stays. A device, a FIFO or a path under ``/dev`` or ``/proc`` (:func:`written_in_place`)
    is opened and written directly: there is no file to replace, so a failure may leave part of
    the content written there."""

    def __init__(self, path: str | os.PathLike, binary: bool = False) -> None:
        self.path = Path(path)
        if self.path.is_dir():
            raise IsADirectoryError(f"{self.path} is a directory")
        self.temporary: str | None = None
        opened = (lambda where: open(where, "wb") if binary else
                  open(where, "w", newline="", encoding="utf-8"))
        if written_in_place(self.path):
            self.handle: IO = opened(self.path)
            return
        self._destination = Path(os.path.realpath(self.path))
        self._destination.parent.mkdir(parents=True, exist_ok=True)
        fd, self.temporary = tempfile.mkstemp(dir=self._destination.parent,
                                              prefix=f".{self._destination.name}.", suffix=".part")
        try:
            self.handle = opened(fd)
        except BaseException:
            os.close(fd)
            os.unlink(self.temporary)
            raise

    def commit(self) -> None:
        """fsync, the permissions a previous file had (else a new file's under the umask), rename;
        for a file written in place, flush and close."""
        self._finish_writing()
        if self.temporary is not None:
            _replace(self.temporary, self._destination)

    def _finish_writing(self) -> None:
        """Flush and close, then flush the temporary to disk (whoever wrote it): a full disk fails
        here, before a rename."""
        self.handle.flush()
        self.handle.close()
        if self.temporary is not None:
            with open(self.temporary, "rb") as written:
                os.fsync(written.fileno())

    def discard(self) -> None:
        with contextlib.suppress(OSError):  # a full disk fails the flush of closing again
            self.handle.close()
        if self.temporary is not None and os.path.exists(self.temporary):
            os.unlink(self.temporary)

    def __enter__(self) -> AtomicFile:
        return self

    def __exit__(self, *exc_info) -> None:
        self.discard()


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, binary: bool = False) -> Iterator[IO]:
    """``with atomic_write(path) as f: f.write(...)``: the handle of an :class:`AtomicFile`,
    committed when the block ends normally, removed otherwise."""
    with AtomicFile(path, binary) as output:
        yield output.handle
        output.commit()


def commit_together(outputs: Iterable[AtomicFile]) -> None:
    """Put several :class:`AtomicFile` s in place as one, the outputs of one run that belong
    together (a table and the arrays whose rows are its rows): all of them or none. Each is first
    flushed to disk (a full disk fails here, before any path changes); then each is renamed onto
    its path while a hard link keeps the file it replaces, so that a rename that fails puts back
    the files already replaced (stop signals wait meanwhile). Files written in place (a device,
    a FIFO: nothing to put back) are flushed after the renames."""
    outputs = list(outputs)
    for output in outputs:
        if output.temporary is not None:
            output._finish_writing()
    with hold_stop_signals():
        done: list[tuple[AtomicFile, bool, str | None]] = []  # (output, it replaced a file, that file)
        try:
            for output in outputs:
                if output.temporary is None:
                    continue
                existed, previous = output._destination.exists(), None
                if existed:
                    previous = tempfile.mktemp(dir=output._destination.parent,
                                               prefix=f".{output._destination.name}.", suffix=".previous")
                    try:
                        os.link(output._destination, previous)
                    except OSError:  # no hard links there: that file cannot be put back
                        previous = None
                done.append((output, existed, previous))
                _replace(output.temporary, output._destination)
        except BaseException:
            for output, existed, previous in reversed(done):
                if previous is not None:
                    os.replace(previous, output._destination)
                elif not existed and not os.path.exists(output.temporary):  # a new file: it goes
                    output._destination.unlink(missing_ok=True)
            raise
        finally:
            for _, _, previous in done:
                if previous is not None and os.path.exists(previous):
                    os.unlink(previous)
    for output in outputs:
        if output.temporary is None:
            output._finish_writing()


def _replace(temporary: str | os.PathLike, path: Path) -> None:
    """Rename the written ``temporary`` onto ``path`` with the permissions a previous file had
    (else a new file's under the umask; ``mkstemp`` creates it owner-only)."""
    mode = path.stat().st_mode & 0o777 if path.exists() else 0o666 & ~_umask()
    os.chmod(temporary, mode)
    os.replace(temporary, path)


#: The lock file inside a folder's temporary, held by the build that makes it.
_BUILDING = ".building.lock"


class AtomicDirectory:
    """A folder built in :attr:`tmp` beside ``path`` and moved onto it by :meth:`commit`; removed
    on leaving the ``with`` block (after a commit there is nothing left to remove).

    The build holds the lock file :data:`_BUILDING` inside :attr:`tmp`, so that the next build of
    ``path`` removes the temporaries whose lock no process holds: those a killed build left. A
    temporary swept between its making and its lock is given up for another."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        prefix = f".{self.path.name}.tmp-"
        for left in self.path.parent.glob(f"{glob.escape(prefix)}*"):
            if left.is_dir() and not left.is_symlink():
                with contextlib.suppress(filelock.Timeout, OSError):
                    with filelock.FileLock(left / _BUILDING, blocking=False):  # no build holds it
                        shutil.rmtree(left, ignore_errors=True)
        while True:
            self.tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=self.path.parent))
            self._held = filelock.FileLock(self.tmp / _BUILDING, blocking=False)
            with contextlib.suppress(filelock.Timeout, FileNotFoundError):  # another build's sweep
                self._held.acquire()
                break
        self.tmp.chmod(0o777 & ~_umask())  # mkdtemp makes it private; the folder it becomes should not be

    def commit(self) -> None:
        """fsync every file and the folder, replace what stands at ``path`` (renamed aside first,
        so that no reader sees a half-deleted folder), fsync the parent. The lock file goes once
        the folder is in place: a sweep never finds the temporary without it."""
        for file in self.tmp.iterdir():
            if file.is_file():
                _fsync(file)
        _fsync(self.tmp)
        if self.path.exists():
            stale = Path(tempfile.mkdtemp(prefix=f".{self.path.name}.stale-", dir=self.path.parent))
            os.replace(self.path, stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
        os.replace(self.tmp, self.path)
        (self.path / _BUILDING).unlink()
        _fsync(self.path.parent)

    def __enter__(self) -> AtomicDirectory:
        return self

    def __exit__(self, *exc_info) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
        self._held.release()


def hold_directory(directory: Path, lock_name: str, holder: str, advice: str) -> filelock.FileLock:
    """An exclusive lock on ``directory`` (its file ``lock_name``, which then holds this
    process's pid) until its ``release()``, or until the process ends, killed or not.
    ``ValueError`` when another process holds it:
    ``<directory> is in use by another <holder> (pid N); <advice>``."""
    directory.mkdir(parents=True, exist_ok=True)

    def acquired(fd: int) -> None:  # the lock file names its holder
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)

    lock = filelock.FileLock(directory / lock_name, blocking=False, on_acquired=acquired)
    try:
        lock.acquire()
    except filelock.Timeout:
        pid = ""
        with contextlib.suppress(OSError):
            pid = (directory / lock_name).read_text().strip()
        raise ValueError(f"{directory} is in use by another {holder} (pid {pid or 'unknown'}); {advice}") from None
    return lock


def is_local_path(path: str | os.PathLike) -> bool:
    """Whether ``path`` is on the local file system (fsspec's ``file`` protocol, as Lightning
    reads it), not ``s3://`` and the like."""
    from fsspec.utils import get_protocol

    return get_protocol(os.fspath(path)) == "file"

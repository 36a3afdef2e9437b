"""Files put in place whole or not at all, the checks of input and output paths, and the folder locks.

A file is written to a temporary sibling (an :class:`AtomicFile`), flushed to disk and renamed onto
its path: a reader, a crash or a kill sees the previous content or the new one. One file:
:func:`atomic_write`; several, or one whose commit is decided later: :func:`commit_together`; a
folder: :class:`AtomicDirectory`. Every lock is ``filelock``'s, which the kernel drops when its
process ends.
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
    """Whether ``a`` and ``b`` name one file (links included)."""
    if os.path.exists(a) and os.path.exists(b):
        return os.path.samefile(a, b)
    return Path(a).resolve() == Path(b).resolve()


def check_writable_dir(directory: str | os.PathLike, option: str) -> None:
    """One-line ``ValueError`` naming ``option`` unless a file can be created in ``directory`` (made if missing)."""
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        raise ValueError(f"{option} {directory} cannot be written ({exc.strerror or exc})") from None


def check_creatable_dir(path: Path, option: str) -> None:
    """One-line ``ValueError`` naming ``option`` unless ``path`` is, or can be made, a writable
    directory (nothing is created)."""
    existing = Path(path).absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{option} {path} cannot be written ({existing} is not a directory)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{option} {path} cannot be written ({existing} is read-only)")


_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def unreadable_as_a_file(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot be read as an input file (``"is a directory"``, ...), or None for a regular
    file: inputs are read more than once, which a pipe or standard input cannot give."""
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
    return next((f"is {kind}, not a regular file" for is_kind, kind in _KINDS if is_kind(mode)),
                "is not a regular file")


def written_in_place(path: str | os.PathLike) -> bool:
    """Whether ``path`` is written where it stands, not replaced: a device, a FIFO, a socket, or a
    name of an open file (``/dev/stdout``, ``/dev/fd/N``, ``/proc/...``)."""
    absolute = Path(path).absolute()
    return ((absolute.exists() and not absolute.is_file())
            or str(absolute).startswith(("/dev/stdout", "/dev/stderr", "/dev/fd/", "/proc/")))


def _fsync(path: str | os.PathLike) -> None:
    """Flush a file, or a folder's entries, to disk where the platform can."""
    with contextlib.suppress(OSError):  # a folder cannot be opened on every platform
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class AtomicFile:
    """A file written beside ``path`` (``handle``: text with ``newline=""`` and UTF-8, or binary;
    ``temporary``: its path), put in place by :func:`commit_together`; removed by :meth:`discard` or
    on leaving the ``with`` block. A symbolic link's target gets the content; a
    :func:`written_in_place` path is written directly (``temporary`` None)."""

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

    def _finish_writing(self) -> None:
        """Flush and close, then fsync the temporary (whoever wrote it): a full disk fails here."""
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
    """The handle of an :class:`AtomicFile`, put in place when the block ends normally."""
    with AtomicFile(path, binary) as output:
        yield output.handle
        commit_together([output])


def commit_together(outputs: Iterable[AtomicFile]) -> None:
    """Put :class:`AtomicFile` s in place, all or none: all are flushed first (a full disk fails
    before any path changes), then renamed with the previous file's permissions (else the umask's)
    while a hard link keeps each replaced file, which a failed rename puts back (stop signals wait
    meanwhile)."""
    outputs = list(outputs)
    for output in outputs:
        if output.temporary is not None:
            output._finish_writing()
    with hold_stop_signals():
        done: list[tuple[AtomicFile, bool, str | None]] = []  # (output, it replaced a file, that file)
        try:
            for output in (output for output in outputs if output.temporary is not None):
                path, previous = output._destination, None
                existed = path.exists()
                if existed:
                    previous = tempfile.mktemp(dir=path.parent, prefix=f".{path.name}.", suffix=".previous")
                    try:
                        os.link(path, previous)
                    except OSError:  # no hard links there: that file cannot be put back
                        previous = None
                done.append((output, existed, previous))
                os.chmod(output.temporary, path.stat().st_mode & 0o777 if existed else 0o666 & ~_umask())
                os.replace(output.temporary, path)
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


_BUILDING = ".building.lock"


class AtomicDirectory:
    """A folder built in :attr:`tmp` beside ``path`` and moved onto it by :meth:`commit`; removed on
    leaving the ``with`` block. The build locks :attr:`tmp`, so that the next build removes the
    temporaries that no process holds (a killed build's)."""

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
        """Flush to disk and replace ``path`` (the old folder moved aside first: no reader sees it half-deleted)."""
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
    """An exclusive lock on ``directory`` (its file ``lock_name`` names this process's pid) until
    ``release()`` or the process ends; else ``<directory> is in use by another <holder> (pid N); <advice>``."""
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
    """Whether ``path`` is local (fsspec's ``file`` protocol, as Lightning reads it), not ``s3://``."""
    from fsspec.utils import get_protocol

    return get_protocol(os.fspath(path)) == "file"

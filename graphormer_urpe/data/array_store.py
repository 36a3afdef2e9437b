"""A store of named arrays on disk: a folder of ``.npy`` files plus ``manifest.json`` (format,
the caller's fingerprint, each array's dtype, shape and BLAKE2b checksum), written whole or not
at all, streamed block by block, and rebuilt when missing, stale or damaged (docs/data.md,
"Storage and caches")."""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import mmap
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import filelock
import numpy as np

from graphormer_urpe.utils.files import AtomicDirectory

log = logging.getLogger(__name__)

CACHE_FORMAT = 2
MANIFEST = "manifest.json"
#: Environment variable that turns on checksum verification of every loaded entry.
VERIFY_ENV = "GRAPHORMER_URPE_VERIFY_CACHE"
#: Bytes read or written per step when streaming arrays through files.
BLOCK_BYTES = 1 << 24
#: The ``.npy`` header size numpy writes (format 1.0, with room to grow), rewritten in place.
_HEADER_BYTES = 128


def whole_memmap(array: np.ndarray) -> bool:
    return isinstance(array, np.memmap) and isinstance(array.base, mmap.mmap) and array.flags.c_contiguous


def read_items(array: np.ndarray, first: int, count: int) -> np.ndarray:
    """Items ``first : first + count`` of ``array`` in C order (flat); a whole memory map is read with
    file reads, leaving its pages in the page cache instead of this process's resident set."""
    if not whole_memmap(array):
        return np.ascontiguousarray(array).reshape(-1)[first:first + count]
    out = np.fromfile(array.filename, dtype=array.dtype, count=count, offset=array.offset + first * array.itemsize)
    if len(out) != count:
        raise EOFError(f"{array.filename} ends before item {first + count}")
    return out


def _bytes(array: np.ndarray) -> memoryview:
    return memoryview(array.reshape(-1)).cast("B")


def _hash_data(digest, array: np.ndarray) -> None:
    """``digest`` updated with the data bytes of ``array``, read in blocks (:func:`read_items`)."""
    array = array if whole_memmap(array) else np.ascontiguousarray(array)
    step = max(BLOCK_BYTES // max(array.itemsize, 1), 1)
    for first in range(0, array.size, step):
        digest.update(_bytes(read_items(array, first, min(step, array.size - first))))


def hash_arrays(*arrays: np.ndarray) -> str:
    """BLAKE2b digest of the arrays' dtypes, shapes and bytes (in order)."""
    digest = hashlib.blake2b(digest_size=16)
    for array in arrays:
        digest.update(f"{array.dtype.str}{array.shape}".encode())
        _hash_data(digest, array)
    return digest.hexdigest()


def _npy_header(dtype: np.dtype, shape: Sequence[int]) -> bytes:
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                                                  "fortran_order": False, "shape": tuple(int(s) for s in shape)})
    if header.tell() != _HEADER_BYTES:
        raise ValueError(f"shape {tuple(shape)} does not fit a {_HEADER_BYTES}-byte .npy header")
    return header.getvalue()


class ArrayWriter:
    """One ``.npy`` file written block by block: ``append`` rows ``[k, *row_shape]`` (``axis=1``:
    columns ``[lead, k]``). Plain writes and a header rewritten on close, not ``open_memmap``: the
    row count is known only at the end, and a full disk under a memory map is a SIGBUS instead of
    one ``OSError`` naming the file."""

    def __init__(self, path: Path, dtype, row_shape: Sequence[int] = (), axis: int = 0) -> None:
        self.path, self.dtype, self.row_shape, self.axis = path, np.dtype(dtype), tuple(row_shape), axis
        self.rows = 0
        self.digest = hashlib.blake2b(digest_size=16)
        self._file = open(path, "wb")
        self._file.write(b"\0" * _HEADER_BYTES)
        # axis=1: row r of the [lead, M] array is streamed into its own part file, joined on close
        self._parts = ([open(path.with_suffix(f".part{r}"), "w+b") for r in range(1, row_shape[0])]
                       if axis == 1 else [])

    def append(self, block: np.ndarray) -> None:
        block = np.asarray(block)
        if self.axis == 0:
            block = block.reshape((-1, *self.row_shape)) if self.row_shape else block.reshape(-1)
            rows = [block]
        else:
            if block.ndim != 2 or block.shape[0] != self.row_shape[0]:
                raise ValueError(f"{self.path.name}: expected a [{self.row_shape[0]}, k] block, got {block.shape}")
            rows = list(block)
        data = np.ascontiguousarray(rows[0], dtype=self.dtype)
        self._file.write(_bytes(data))
        self.digest.update(_bytes(data))
        for part, row in zip(self._parts, rows[1:]):
            part.write(_bytes(np.ascontiguousarray(row, dtype=self.dtype)))
        self.rows += len(data)

    def close(self) -> dict:
        """Join the parts, write the final header; the manifest entry of the array."""
        for part in self._parts:
            part.seek(0)
            for block in iter(lambda: part.read(BLOCK_BYTES), b""):
                self._file.write(block)
                self.digest.update(block)
            part.close()
            os.unlink(part.name)
        shape = (self.rows, *self.row_shape) if self.axis == 0 else (self.row_shape[0], self.rows)
        self._file.seek(0)
        self._file.write(_npy_header(self.dtype, shape))
        self._file.close()
        return {"dtype": self.dtype.str, "shape": list(shape), "blake2b": self.digest.hexdigest()}

    def abort(self) -> None:
        """Close every file, whatever fails (on a full disk closing fails again)."""
        for handle in (self._file, *self._parts):
            with contextlib.suppress(OSError):
                handle.close()


class EntryWriter:
    """Builds an entry in a temporary sibling directory; :meth:`commit` moves it into place, leaving
    the ``with`` block without it removes it."""

    def __init__(self, directory: str | os.PathLike, fingerprint: dict[str, Any]) -> None:
        self.directory = Path(directory)
        self.fingerprint = fingerprint
        self._folder = AtomicDirectory(self.directory)
        self.tmp = self._folder.tmp
        self.writers: dict[str, ArrayWriter] = {}
        self.entries: dict[str, dict] = {}

    def __enter__(self) -> "EntryWriter":
        return self

    def __exit__(self, *exc) -> None:
        try:
            for writer in self.writers.values():
                writer.abort()
        finally:
            self._folder.__exit__(*exc)

    def array(self, name: str, dtype, row_shape: Sequence[int] = (), axis: int = 0) -> ArrayWriter:
        """A streaming writer for array ``name`` (see :class:`ArrayWriter`)."""
        writer = ArrayWriter(self.tmp / f"{name}.npy", dtype, row_shape, axis)
        self.writers[name] = writer
        return writer

    def write(self, name: str, array: np.ndarray, convert: Callable[[np.ndarray], np.ndarray] | None = None,
              dtype=None) -> None:
        """Array ``name`` from ``array``, read (:func:`read_items`) and written block by block, each
        block ``convert``-ed to ``dtype`` where given."""
        array = array if isinstance(array, np.ndarray) else np.asarray(array)  # a memory map stays one
        if array.ndim == 0:
            raise ValueError(f"{name}: a cache array needs at least one dimension")
        writer = self.array(name, array.dtype if dtype is None else dtype, array.shape[1:])
        row = int(np.prod(array.shape[1:], dtype=np.int64))  # items per row
        rows_per_block = max(BLOCK_BYTES // max(array[:1].nbytes, 1), 1)
        for start in range(0, len(array), rows_per_block):
            count = min(rows_per_block, len(array) - start)
            rows = read_items(array, start * row, count * row).reshape((-1, *array.shape[1:]))
            writer.append(rows if convert is None else convert(rows))

    def commit(self) -> None:
        for name, writer in self.writers.items():
            self.entries[name] = writer.close()
        self.writers = {}
        manifest = {"format": CACHE_FORMAT, "fingerprint": self.fingerprint, "arrays": self.entries}
        with open(self.tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
        self._folder.commit()  # a stale entry at the path is replaced


def file_checksum(path: str | os.PathLike) -> str:
    """BLAKE2b of the data of a ``.npy`` file (what the manifest records)."""
    digest = hashlib.blake2b(digest_size=16)
    _hash_data(digest, np.load(path, mmap_mode="r", allow_pickle=False))  # an empty one is not memory-mapped
    return digest.hexdigest()


class _Damaged(Exception):
    """A cache entry that exists but cannot be trusted (message: file and reason)."""


def _read_entry(directory: Path, fingerprint: dict[str, Any], expect: Sequence[str], mmap_arrays: bool,
                verify: bool) -> dict[str, np.ndarray] | None:
    """The entry, None when missing or stale; :class:`_Damaged` when it cannot be trusted."""
    manifest_path = directory / MANIFEST
    if not manifest_path.exists():
        return None
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as err:
        raise _Damaged(f"{manifest_path}: unreadable manifest ({err})") from None
    if not isinstance(manifest, dict):
        raise _Damaged(f"{manifest_path}: the manifest is a {type(manifest).__name__}, not an object")
    if manifest.get("format") != CACHE_FORMAT or manifest.get("fingerprint") != json.loads(json.dumps(fingerprint)):
        return None  # stale: another format, parameters or input
    entries = manifest.get("arrays")
    if not isinstance(entries, dict) or not entries:
        raise _Damaged(f"{manifest_path}: 'arrays' is {entries!r}, not a non-empty object")
    missing = [name for name in expect if name not in entries]
    if missing:
        raise _Damaged(f"{manifest_path}: arrays {missing} are not listed")
    arrays = {}
    for name, entry in entries.items():
        path = directory / f"{name}.npy"
        if not isinstance(entry, dict) or not {"dtype", "shape", "blake2b"} <= set(entry):
            raise _Damaged(f"{manifest_path}: the record of {name!r} is {entry!r} "
                           "(needs dtype, shape and blake2b)")
        try:
            array = np.load(path, mmap_mode="r" if mmap_arrays else None, allow_pickle=False)
        except (OSError, ValueError, EOFError) as err:
            size = path.stat().st_size if path.exists() else None
            why = "missing" if size is None else "empty (0 bytes)" if size == 0 else f"unreadable ({err})"
            raise _Damaged(f"{path}: {why}") from None
        if array.dtype.str != entry["dtype"] or list(array.shape) != entry["shape"]:
            raise _Damaged(f"{path}: holds {array.dtype.str} {list(array.shape)}, the manifest says "
                           f"{entry['dtype']} {entry['shape']}")
        if verify and file_checksum(path) != entry["blake2b"]:
            raise _Damaged(f"{path}: checksum mismatch (the data changed after it was written)")
        arrays[name] = array
    return arrays


def load_arrays(directory: str | os.PathLike, fingerprint: dict[str, Any], mmap: bool = True,
                expect: Sequence[str] = (), verify: bool | None = None) -> dict[str, np.ndarray] | None:
    """The arrays of entry ``directory`` if it was written with exactly ``fingerprint``, lists every
    name in ``expect`` and every file matches the manifest (with ``verify`` or
    :data:`VERIFY_ENV`, its checksum too); else None (a damaged entry is logged as a warning)."""
    directory = Path(directory)
    try:
        if verify is None:
            verify = os.environ.get(VERIFY_ENV, "").strip().lower() not in ("", "0", "false", "no")
        return _read_entry(directory, fingerprint, expect, mmap, bool(verify))
    except _Damaged as damaged:
        log.warning("cache entry %s is damaged, rebuilding it: %s", directory, damaged)
        return None


def _manifest_identity(directory: Path) -> tuple | None:
    try:
        stat = (directory / MANIFEST).stat()
    except OSError:
        return None
    return stat.st_ino, stat.st_mtime_ns, stat.st_size


def cached_entry(directory: str | os.PathLike, fingerprint: dict[str, Any], build: Callable[[EntryWriter], None],
                 expect: Sequence[str] = (), verify: bool | None = None) -> dict[str, np.ndarray]:
    """The entry ``directory`` for ``fingerprint``, built first with ``build(writer)`` when missing,
    stale or damaged, under a file lock: the first builder builds, the others then load its result."""
    directory = Path(directory)
    seen = _manifest_identity(directory)
    arrays = load_arrays(directory, fingerprint, expect=expect, verify=verify)
    if arrays is not None:
        return arrays
    directory.parent.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(directory.parent / f".{directory.name}.lock"):
        if _manifest_identity(directory) != seen:  # another process wrote the entry while we waited
            arrays = load_arrays(directory, fingerprint, expect=expect, verify=verify)
            if arrays is not None:
                return arrays
        with EntryWriter(directory, fingerprint) as writer:
            build(writer)
            writer.commit()
    arrays = load_arrays(directory, fingerprint, expect=expect, verify=False)
    if arrays is None:
        raise RuntimeError(f"cache entry {directory} does not load right after it was written")
    return arrays


def checksums(directory: str | os.PathLike) -> dict[str, str]:
    """``{array: BLAKE2b of its data}`` as the manifest of entry ``directory`` records them."""
    return {name: entry["blake2b"] for name, entry in
            json.loads((Path(directory) / MANIFEST).read_text())["arrays"].items()}

"""Where local copies of the data sets are: one directory, ``$GRAPHORMER_URPE_DATA`` (layout and
defaults: docs/data.md); ``data:<relative path>`` names a file of it (:func:`data_file`), and
:func:`built_under` says in one line when a build folder cannot be written."""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from graphormer_urpe.utils.files import atomic_write

DATA_ENV = "GRAPHORMER_URPE_DATA"
_OLD_DATA_ENV = "GRAPHORMER_URPE_SHARED_DATA"
_CHECKOUT = Path(__file__).resolve().parents[2]
#: The default in a source checkout: ``shared/data`` beside the checkout holding this package.
CHECKOUT_COPY = _CHECKOUT.parent / "shared" / "data"
#: Whether the package runs from a source checkout (not from an installed wheel).
IN_CHECKOUT = (_CHECKOUT / "pyproject.toml").is_file() and (_CHECKOUT / "graphormer_urpe").is_dir()
#: How a recipe names a file of the local data copies: ``data:moleculenet/esol.csv``.
DATA_PREFIX = "data:"

#: The files of each copy, relative to the directory (for messages naming what is missing).
ZINC = "zinc"
PCQM4MV2_SLICE = "pcqm4mv2/pcqm4mv2_first2k_3d.csv.gz"
ESOL = "moleculenet/esol.csv"
#: Public addresses of the files :func:`data_file` downloads when no copy holds them.
DOWNLOADS = {ESOL: "https://deepchemdata.s3-us-west-1.amazonaws.com/datasets/delaney-processed.csv"}
DOWNLOAD_TIMEOUT_S = 60


def cache_data_dir() -> Path:
    """The user's data cache, ``$XDG_CACHE_HOME/graphormer-urpe/data`` (``~/.cache/...``)."""
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache).expanduser() / "graphormer-urpe" / "data"


def local_data_dir() -> Path:
    """``$GRAPHORMER_URPE_DATA``, else :data:`CHECKOUT_COPY` in a source checkout, else
    :func:`cache_data_dir` (none of them need exist)."""
    for name in (DATA_ENV, _OLD_DATA_ENV):
        if os.environ.get(name):
            return Path(os.environ[name]).expanduser()
    return CHECKOUT_COPY if IN_CHECKOUT else cache_data_dir()


def local_copy(relative: str) -> Path | None:
    """``<local data dir>/<relative>`` when it exists, else None."""
    path = local_data_dir() / relative
    return path if path.exists() else None


def where_to_put(relative: str) -> str:
    """Where a missing copy belongs, in words (for one-line messages)."""
    return (f"{local_data_dir() / relative} (${DATA_ENV} names the directory of local data "
            f"copies, by default {cache_data_dir()}, or ../shared/data beside a source checkout)")


def data_file(path: str | os.PathLike) -> Path:
    """The file a data option names: ``path`` itself, or for ``data:<relative>`` the file of the
    local copies, else of the user's data cache, else downloaded there once where
    :data:`DOWNLOADS` has its address; else a ``ValueError`` naming where to put it."""
    text = os.fspath(path)
    if not text.startswith(DATA_PREFIX):
        return Path(text)
    relative = text[len(DATA_PREFIX):].lstrip("/")
    found = local_copy(relative)
    if found is not None:
        return found
    cached = cache_data_dir() / relative
    if cached.is_file():
        return cached
    url = DOWNLOADS.get(relative)
    if url is None:
        raise ValueError(f"{text}: no local copy of {relative}; expected at {where_to_put(relative)}")
    try:
        with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as response, \
                atomic_write(cached, binary=True) as out:
            shutil.copyfileobj(response, out)
    except OSError as exc:  # URLError, timeouts, refused connections, an unwritable cache
        raise ValueError(f"{text}: no local copy of {relative} (expected at {where_to_put(relative)}) "
                         f"and its download from {url} to {cached} failed ({getattr(exc, 'reason', None) or exc})"
                         ) from None
    return cached


#: ``errno`` of a folder or file that cannot be created: a read-only file system, no permission.
_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


@contextlib.contextmanager
def built_under(root: str | os.PathLike, option: str) -> Iterator[None]:
    """Within the block (a data set's build), a folder or file in or above ``root`` that cannot be
    created is a one-line ``ValueError`` naming ``root`` and the ``option`` that moves it; a
    read-only ``root`` that holds everything already built is read as it is."""
    try:
        yield
    except OSError as error:
        if error.errno not in _NOT_WRITABLE or error.filename is None:
            raise
        failed, folder = Path(os.path.abspath(error.filename)), Path(os.path.abspath(root))
        if not (failed.is_relative_to(folder) or folder.is_relative_to(failed)):  # in it, or a folder above it
            raise
        raise ValueError(f"{option} {root} cannot be written ({error.strerror}: {error.filename}): the "
                         f"data is built there; choose a folder that can be written with {option}") from None

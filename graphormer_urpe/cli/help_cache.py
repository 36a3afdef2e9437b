"""The training command's ``--help``, kept once rendered.

LightningCLI writes that help from the signatures of the Trainer, the model and the data modules,
which takes importing Lightning: seconds on a 2-core CPU. The text it wrote is kept in the user's
cache folder (``$XDG_CACHE_HOME/graphormer-urpe/help``, else ``~/.cache/...``) under a key of
everything it depends on: the arguments with recipe names resolved, the files they name (a
``--config`` file), the terminal's width, the versions of Python and of the libraries that write
it, and this package's own files, each file by its size and modification time. The same
``--help`` again prints the kept text without importing Lightning; a change to any of those makes
a new key, so a kept text is never out of date. A cache folder that cannot be written only means
the help is written anew each time.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from graphormer_urpe.utils.files import atomic_write

HELP_FLAGS = ("-h", "--help")
#: the libraries whose code writes the help
WRITERS = ("lightning", "jsonargparse", "torch")
#: kept texts beyond these many, the oldest go
KEPT = 32
PACKAGE_DIR = Path(__file__).resolve().parents[1]


def asks_for_help(args: list[str]) -> bool:
    """Whether ``args`` ask for help (before a ``--`` that ends the options)."""
    options = args[:args.index("--")] if "--" in args else args
    return any(word in HELP_FLAGS for word in options)


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "graphormer-urpe" / "help"


def _file_stamp(path: Path) -> str:
    """``path`` with its size and modification time: what says that a file changed (the package's
    own files, a ``--config`` file), without reading it (an argument may name a large data file)."""
    stat = path.stat()
    return f"{path}:{stat.st_size}:{stat.st_mtime_ns}"


def _named_file_stamp(word: str) -> str:
    """The stamp of the file that ``word`` (an argument, or an option's ``=value``) names, if any."""
    for candidate in (word, word.partition("=")[2]):
        if candidate:
            with contextlib.suppress(OSError, ValueError):
                if os.path.isfile(candidate):
                    return _file_stamp(Path(candidate).resolve())
    return ""


def help_key(args: list[str]) -> str:
    """The key of the help that ``args`` (recipe names resolved) ask for."""
    parts = [sys.version, str(shutil.get_terminal_size().columns), *args,
             *map(_named_file_stamp, args)]
    for library in WRITERS:
        with contextlib.suppress(metadata.PackageNotFoundError):
            parts.append(f"{library}=={metadata.version(library)}")
    parts += [_file_stamp(path) for path in sorted(PACKAGE_DIR.rglob("*")) if path.suffix in (".py", ".yaml", ".so")]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def print_help(args: list[str], write_help: Callable[[], object]) -> int:
    """Print the help ``args`` (recipe names resolved) ask for: the kept text, else what
    ``write_help()`` prints (it ends in ``SystemExit``, as argparse's help does), kept for next time. A help that fails
    (an unknown option: argparse's exit status 2) is not kept; its status is returned."""
    kept = cache_dir() / f"{help_key(args)}.txt"
    try:
        text = kept.read_text()
    except OSError:  # not kept yet (or unreadable): written below
        pass
    else:
        sys.stdout.write(text)
        return 0
    written = io.StringIO()
    try:
        with contextlib.redirect_stdout(written):
            write_help()
        status = 0
    except SystemExit as end:
        status = end.code if isinstance(end.code, int) else (0 if end.code is None else 1)
    text = written.getvalue()
    sys.stdout.write(text)
    if status == 0 and text:
        _keep(kept, text)
    return status


def _keep(path: Path, text: str) -> None:
    """Write ``path`` whole and drop all but the newest :data:`KEPT` texts; a folder that cannot
    be written is left alone."""
    with contextlib.suppress(OSError):
        with atomic_write(path) as kept:
            kept.write(text)
        for old in sorted(path.parent.glob("*.txt"), key=lambda kept: kept.stat().st_mtime_ns)[:-KEPT]:
            old.unlink()

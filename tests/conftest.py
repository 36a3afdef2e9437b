"""Fixtures shared by the whole test suite (keep this file small)."""
import contextlib
import hashlib
import inspect
import os
import shutil
import socket
import tempfile
from pathlib import Path
from typing import NoReturn

import filelock
import pytest

import graphormer_urpe.data.featurize as featurize_module
import graphormer_urpe.data.zinc as zinc_module
from graphormer_urpe.data import local_data

pytest_plugins = ["pytester"]  # tests/data/test_local_data.py runs this file's fixtures in a child session

#: Set (to 1) where the data must be there, as in CI: a missing data set fails its tests
#: instead of skipping them.
REQUIRE_DATA_ENV = "GRAPHORMER_URPE_REQUIRE_DATA"
#: Per socket operation, so that a download attempt without a network fails instead of hanging.
DOWNLOAD_TIMEOUT_S = 30
#: The folder of long data builds in pytest's cache (``.pytest_cache/d/<this>``).
DATA_BUILD_CACHE = "graphormer_urpe_datasets"
#: MoleculeNet ESOL as PyG's ``MoleculeNet("ESOL")`` downloads it (deepchem's copy).
ESOL_URL = local_data.DOWNLOADS[local_data.ESOL]


def pytest_configure(config) -> None:
    """The default handling of Ctrl-C and SIGHUP in every command a test starts, whatever this
    session inherited: a suite started with them ignored (``make test &`` from a script,
    ``nohup``) would pass SIG_IGN on to its commands (an ignored signal stays ignored across
    ``exec``, and the commands keep it ignored), so the tests that stop a command with SIGINT or
    SIGHUP would fail. A Python handler here is reset to the default in each child at ``exec``;
    the session itself still ignores SIGHUP.

    The user's cache folder is one of this session's own, so that a help text the commands keep
    there (:mod:`graphormer_urpe.cli.help_cache`) is neither read from nor left in the user's."""
    import signal

    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="graphormer-urpe-test-cache-")

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if hasattr(signal, "SIGHUP") and signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
        signal.signal(signal.SIGHUP, lambda signum, frame: None)


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked ``gpu`` are skipped where torch sees no CUDA device."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


def missing_data(what: str, relative: str, download_error: Exception | None = None) -> NoReturn:
    """Skip (or, with ``$GRAPHORMER_URPE_REQUIRE_DATA``, fail) the test, in one line naming what
    is missing and where to put it."""
    tried = f" (the download failed: {type(download_error).__name__}: {download_error})" \
        if download_error is not None else ""
    message = f"missing {what}{tried}; expected at {local_data.where_to_put(relative)}"
    if os.environ.get(REQUIRE_DATA_ENV, "").strip().lower() not in ("", "0", "false", "no"):
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


@contextlib.contextmanager
def download_timeout():
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_S)
    try:
        yield
    finally:
        socket.setdefaulttimeout(previous)


def local_copy(what: str, relative: str) -> Path:
    """``<local data copies>/<relative>``, or the test is skipped naming what is missing."""
    path = local_data.local_copy(relative)
    if path is None:
        missing_data(what, relative)
    return path


@pytest.fixture(scope="session")
def zinc_source() -> Path:
    """The ZINC source files (:func:`~graphormer_urpe.data.zinc.resolve_zinc_source`: the exact
    official subset val/test graphs, the JT-VAE SMILES and labels); no download has them."""
    path = zinc_module.resolve_zinc_source(None)
    if path is None:
        missing_data("the ZINC source files (JT-VAE SMILES, subset index files and graphs)", local_data.ZINC)
    return path


@pytest.fixture(scope="session")
def esol_csv(data_build_cache) -> Path:
    """MoleculeNet ESOL: the local copy, else downloaded once into the test cache."""
    path = local_data.local_copy(local_data.ESOL)
    if path is not None:
        return path
    path = data_build_cache / "esol" / "delaney-processed.csv"
    if not path.is_file():
        from torch_geometric.data import download_url

        partial = Path(tempfile.mkdtemp(dir=data_build_cache))
        try:
            with download_timeout():
                path.parent.mkdir(exist_ok=True)
                os.replace(download_url(ESOL_URL, str(partial), log=False), path)
        except OSError as err:  # URLError, timeouts, refused connections
            failed = err
        else:
            failed = None
        finally:
            shutil.rmtree(partial, ignore_errors=True)
        if failed is not None:  # outside the handler: the message alone, no chained traceback
            missing_data("MoleculeNet ESOL (esol.csv)", local_data.ESOL, failed)
    return path


@pytest.fixture(scope="session")
def pcqm_source() -> Path:
    """A real slice of PCQM4Mv2 (1,999 molecules with explicit-H 3D CXSMILES): a local copy only."""
    return local_copy("the PCQM4Mv2 slice", local_data.PCQM4MV2_SLICE)


@pytest.fixture(scope="session")
def data_build_cache(request) -> Path:
    """A directory kept across test sessions (under ``.pytest_cache``) for datasets that take long
    to build; callers key subdirectories by everything that affects the build. The same folder
    without pytest's cache plugin (``-p no:cacheprovider``), which then gives no ``config.cache``."""
    cache = getattr(request.config, "cache", None)
    if cache is not None:
        return Path(cache.mkdir(DATA_BUILD_CACHE))
    path = Path(request.config.rootpath) / ".pytest_cache" / "d" / DATA_BUILD_CACHE
    path.mkdir(parents=True, exist_ok=True)
    return path


def _zinc_build_key(source: Path) -> str:
    """What a ZINC build depends on: the ZINC building code, the ZINC featurizer (not the rest of
    featurize.py, so unrelated edits keep the cached build) and the source files' sizes."""
    digest = hashlib.sha256(Path(zinc_module.__file__).read_bytes())
    for function in (featurize_module.zinc_atom_token, featurize_module.smiles_to_zinc_dense,
                     featurize_module.smiles_to_zinc_graph):
        digest.update(inspect.getsource(function).encode())
    digest.update(repr(featurize_module.ZINC_ATOM_TOKENS).encode())
    for path in sorted(source.iterdir()):
        digest.update(f"{path.name}:{path.stat().st_size}".encode())
    return digest.hexdigest()[:16]


def _build_lock(root: Path) -> filelock.FileLock:
    """The lock beside ``root`` that a data build of it holds (``.<name>.lock``, as the encoding
    cache's entries have), so that test workers (pytest -n) build it once."""
    root.parent.mkdir(parents=True, exist_ok=True)
    return filelock.FileLock(root.parent / f".{root.name}.lock")


@pytest.fixture(scope="session")
def zinc_root(data_build_cache) -> Path:
    """A built ZINC root: from the local ZINC source files by :func:`build_zinc_raw` (keyed by the
    building code and the source files, so a change rebuilds it), else PyG's official download."""
    source = zinc_module.resolve_zinc_source(None)
    if source is not None:
        root = data_build_cache / f"zinc-{_zinc_build_key(source)}"
        with _build_lock(root):  # test workers (pytest -n) build it once, one after another
            zinc_module.load_zinc(root, subset=True, split="train", source_dir=source)
        return root
    root = data_build_cache / "zinc-download"
    try:
        with download_timeout(), _build_lock(root):
            zinc_module.load_zinc(root, subset=True, split="train")
    except OSError as err:
        failed = err
    else:
        return root
    missing_data("ZINC (PyG's molecules.zip, or the ZINC source files to build it from)",
                 local_data.ZINC, failed)


@pytest.fixture
def zinc_data_root(zinc_root, tmp_path):
    """A ``root`` whose ``ZINC`` is the session's built ZINC (read-mostly; encodings cached there)."""
    (tmp_path / "ZINC").symlink_to(zinc_root, target_is_directory=True)
    return tmp_path


@pytest.fixture
def run_main(capsys):
    """``run_main(main, args) -> CompletedProcess``: a command's ``main(args)`` run in the test
    process (what its console script runs, without a process start of ~6 s): its exit status and
    what it printed to stdout and stderr (logging goes to pytest's handlers: ``caplog``)."""
    import subprocess

    def run(main, args) -> subprocess.CompletedProcess:
        args = [str(a) for a in args]
        capsys.readouterr()
        status = main(args)
        captured = capsys.readouterr()
        return subprocess.CompletedProcess(args, status, captured.out, captured.err)

    return run


@pytest.fixture(autouse=True)
def commands_leave_no_process_state():
    """A command run by its ``main()`` in the test process leaves what it sets for the rest of
    its process: Lightning's ``PL_GLOBAL_SEED`` (which child processes started later would
    inherit) and the package logger's level. Both are put back after every test."""
    import logging

    seed = os.environ.get("PL_GLOBAL_SEED")
    logger = logging.getLogger("graphormer_urpe")
    level = logger.level
    yield
    logger.setLevel(level)
    if seed is None:
        os.environ.pop("PL_GLOBAL_SEED", None)
    else:
        os.environ["PL_GLOBAL_SEED"] = seed


@pytest.fixture
def one_torch_thread():
    """Many small ops: on a 2-core CPU shared with other jobs one torch thread is far faster than two
    competing with other jobs (~50x for the resident gathers)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)



class _RunsCodeWhenUnpickled:
    """Unpickling this object creates ``marker``: the proof that a load ran code from the file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


@pytest.fixture
def plant_crafted_checkpoint():
    """``plant(path) -> marker``: writes at ``path`` a torch file shaped like a Lightning checkpoint
    (and an ensemble state) whose loading with ``weights_only=False`` creates ``marker``."""
    def plant(path: Path) -> Path:
        import torch

        marker = path.with_name(path.name + ".code-ran")
        payload = _RunsCodeWhenUnpickled(marker)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"state_dict": {}, "hyper_parameters": {"hook": payload}, "global_step": payload,
                    "members": payload}, path)
        return marker

    return plant


@pytest.fixture
def start_lock_holder():
    """``start(command, lock, **popen_kwargs) -> process``: the command started, once it holds
    ``lock`` (a :func:`~graphormer_urpe.utils.files.hold_directory` lock file naming its pid)."""
    import subprocess
    import time

    started = []

    def start(command: list[str], lock: Path, **popen_kwargs) -> subprocess.Popen:
        process = subprocess.Popen(command, text=True, **popen_kwargs)
        started.append(process)
        deadline = time.monotonic() + 300
        while process.poll() is None and time.monotonic() < deadline and not (
                lock.exists() and lock.read_text().strip()):
            time.sleep(0.05)
        assert lock.read_text().strip() == str(process.pid)
        return process

    yield start
    for process in started:  # one that a test left running
        process.kill()
        process.communicate()


def fused_kernels_run_here() -> bool:
    """Whether the fused attention kernels run in this process: on a GPU, or under Triton's CPU
    interpreter (a session started with ``TRITON_INTERPRET=1``)."""
    import torch

    pytest.importorskip("triton")
    from graphormer_urpe.nn import fused_attention

    return torch.cuda.is_available() or fused_attention.TRITON_INTERPRETED


@pytest.fixture
def under_triton_interpreter():
    """``run(test_file, selection, passed)``: runs the tests of ``test_file`` that ``-k
    selection`` picks in a child pytest where Triton's CPU interpreter runs the fused attention
    kernels (``TRITON_INTERPRET=1``, which must be set before triton is first imported), and
    checks that exactly ``passed`` ran and passed, none skipped. Skips where the kernels already
    run in this process (a GPU, or a session started under the interpreter)."""
    import subprocess
    import sys

    if fused_kernels_run_here():
        pytest.skip("the kernels run in this process")

    def run(test_file: str, selection: str, passed: int) -> None:
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, "-k", selection],
            cwd=Path(__file__).resolve().parents[1], env={**os.environ, "TRITON_INTERPRET": "1"},
            capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
        summary = result.stdout.strip().splitlines()[-1]
        assert f"{passed} passed" in summary and "skipped" not in summary, summary

    return run


@pytest.fixture
def fused_kernel_calls(monkeypatch) -> list:
    """One entry per call of the fused attention kernels during the test, where they run in this
    process; elsewhere the test skips, and its ``under_triton_interpreter`` twin runs it in a child
    process under Triton's interpreter."""
    if not fused_kernels_run_here():
        pytest.skip("no GPU: run under Triton's interpreter by its *_under_the_cpu_interpreter twin")
    from graphormer_urpe.nn import fused_attention

    calls = []
    apply = fused_attention._FusedURPEAttention.apply
    monkeypatch.setattr(fused_attention._FusedURPEAttention, "apply", lambda *args: calls.append(1) or apply(*args))
    return calls

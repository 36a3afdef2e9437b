"""Fixtures shared by the whole test suite (keep this file small)."""
import hashlib
import inspect
from pathlib import Path

import pytest

import graphormer_urpe.data.featurize as featurize_module
import graphormer_urpe.data.zinc as zinc_module

#: The project's offline data, beside the checkout (``<repo>/../shared/data``); read-only, never
#: copied into the repository.
SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session")
def zinc_dir() -> Path:
    """``shared/data/zinc``: the exact official ZINC subset val/test graphs and the SMILES."""
    path = SHARED_DATA / "zinc"
    if not path.is_dir():
        pytest.fail(f"real ZINC data not found at {path} (the checkout needs ../shared beside it)")
    return path


@pytest.fixture(scope="session")
def shared_data_dir() -> Path:
    """The offline data directory: ``$GRAPHORMER_URPE_SHARED_DATA``, else ``<repo>/../shared/data``."""
    import os

    path = Path(os.environ.get("GRAPHORMER_URPE_SHARED_DATA") or SHARED_DATA)
    if not path.is_dir():
        pytest.fail(f"shared data not found at {path} (set GRAPHORMER_URPE_SHARED_DATA or put "
                    "../shared beside the checkout)")
    return path


@pytest.fixture(scope="session")
def data_build_cache(request) -> Path:
    """A directory kept across test sessions (under ``.pytest_cache``) for datasets that take long
    to build; callers key subdirectories by everything that affects the build."""
    return Path(request.config.cache.mkdir("graphormer_urpe_datasets"))


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


@pytest.fixture(scope="session")
def zinc_source(shared_data_dir) -> Path:
    return shared_data_dir / "zinc"


@pytest.fixture(scope="session")
def zinc_root(zinc_source, data_build_cache) -> Path:
    """A ZINC root whose raw files were built by :func:`build_zinc_raw` from the shared source,
    keyed by the building code and the source files, so a change rebuilds it."""
    root = data_build_cache / f"zinc-{_zinc_build_key(zinc_source)}"
    zinc_module.load_zinc(root, subset=True, split="train", source_dir=zinc_source)
    return root


@pytest.fixture
def zinc_data_root(zinc_root, tmp_path):
    """A ``root`` whose ``ZINC`` is the session's built ZINC (read-mostly; encodings cached there)."""
    (tmp_path / "ZINC").symlink_to(zinc_root, target_is_directory=True)
    return tmp_path


@pytest.fixture
def one_torch_thread():
    """Many small ops: on a shared 2-core machine one torch thread is far faster than two
    competing with other jobs (~50x for the resident gathers)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

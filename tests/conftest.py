"""Fixtures shared by the whole test suite (keep this file small)."""
from pathlib import Path

import pytest

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

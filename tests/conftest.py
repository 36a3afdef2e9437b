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

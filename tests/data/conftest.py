"""Datasets built once per code version and kept across sessions (building ZINC-full from SMILES
takes a couple of minutes on the 2-core machine; later sessions load PyG's processed files)."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

import graphormer_urpe.data.featurize as featurize_module
import graphormer_urpe.data.zinc as zinc_module


def _fingerprint(*paths: Path) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.name.encode())
        digest.update(path.read_bytes() if path.suffix == ".py" else str(path.stat().st_size).encode())
    return digest.hexdigest()[:16]


@pytest.fixture(scope="session")
def zinc_source(shared_data_dir) -> Path:
    return shared_data_dir / "zinc"


@pytest.fixture(scope="session")
def zinc_root(zinc_source, data_build_cache) -> Path:
    """A ZINC root whose raw files were built by :func:`build_zinc_raw` from the shared source,
    keyed by the building code and the source files, so a change rebuilds it."""
    key = _fingerprint(Path(zinc_module.__file__), Path(featurize_module.__file__),
                       *sorted(zinc_source.iterdir()))
    root = data_build_cache / f"zinc-{key}"
    zinc_module.load_zinc(root, subset=True, split="train", source_dir=zinc_source)
    return root

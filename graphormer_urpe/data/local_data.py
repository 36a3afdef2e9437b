"""Where local copies of the data sets are: one directory, ``$GRAPHORMER_URPE_DATA``.

A machine that cannot reach the data sets' hosts (or should not download them again) keeps
copies in one directory, laid out as::

    zinc/                                 ZINC source files, what :func:`.zinc.build_zinc_raw`
                                          reads (JT-VAE SMILES and labels, the subset index files,
                                          the exact subset val/test graphs, atom_dict.json)
    pcqm4mv2/pcqm4mv2_first2k_3d.csv.gz   a real slice of PCQM4Mv2 (tests and benchmarks)
    moleculenet/esol.csv                  MoleculeNet ESOL (deepchem's delaney-processed.csv)

The directory is ``$GRAPHORMER_URPE_DATA``, by default ``shared/data`` beside the source
checkout (``<checkout>/../shared/data``). Where it does not hold a data set, ZINC is downloaded
by PyG and PCQM4M(v2) by OGB as usual. ``$GRAPHORMER_URPE_SHARED_DATA`` is an older name of the
variable, still read.
"""
from __future__ import annotations

import os
from pathlib import Path

DATA_ENV = "GRAPHORMER_URPE_DATA"
_OLD_DATA_ENV = "GRAPHORMER_URPE_SHARED_DATA"
#: The default: ``shared/data`` beside the source checkout holding this package.
CHECKOUT_COPY = Path(__file__).resolve().parents[2].parent / "shared" / "data"

#: The files of each copy, relative to the directory (for messages naming what is missing).
ZINC = "zinc"
PCQM4MV2_SLICE = "pcqm4mv2/pcqm4mv2_first2k_3d.csv.gz"
ESOL = "moleculenet/esol.csv"


def local_data_dir() -> Path:
    """``$GRAPHORMER_URPE_DATA``, else :data:`CHECKOUT_COPY` (either may not exist)."""
    for name in (DATA_ENV, _OLD_DATA_ENV):
        if os.environ.get(name):
            return Path(os.environ[name]).expanduser()
    return CHECKOUT_COPY


def local_copy(relative: str) -> Path | None:
    """``<local data dir>/<relative>`` when it exists, else None."""
    path = local_data_dir() / relative
    return path if path.exists() else None


def where_to_put(relative: str) -> str:
    """Where a missing copy belongs, in words (for one-line messages)."""
    return (f"{local_data_dir() / relative} (${DATA_ENV} names the directory of local data "
            "copies, by default ../shared/data beside the checkout)")

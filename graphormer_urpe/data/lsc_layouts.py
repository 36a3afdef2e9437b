"""The OGB-LSC PCQM4M versions' layouts (folders, official split sizes, OGB's names): facts that
``graphormer-urpe-submit`` parses its arguments with before torch is imported; the data set is
:mod:`graphormer_urpe.data.ogb_lsc`."""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

RELEASE_MARKER = "RELEASE_v1.txt"
RAW_TABLE = Path("raw") / "data.csv.gz"
SPLIT_FILE = "split_dict.pt"


@dataclass(frozen=True)
class LSCLayout:
    """One OGB-LSC PCQM4M version: its folder, splits with their official sizes (in file order;
    the splits after ``valid`` are the unlabelled test sets), OGB's download and class names."""

    name: str
    folder: str
    split_sizes: Mapping[str, int]
    url: str
    ogb_dataset: str  #: the class in ``ogb.lsc`` (its PyG dataset)
    ogb_evaluator: str  #: the class in ``ogb.lsc``

    @property
    def splits(self) -> tuple[str, ...]:
        return tuple(self.split_sizes)

    @property
    def test_splits(self) -> tuple[str, ...]:
        return self.splits[2:]

    @property
    def num_molecules(self) -> int:
        return sum(self.split_sizes.values())

    def path(self, root: str | os.PathLike) -> Path:
        """``<root>/<folder>``."""
        return Path(root) / self.folder


PCQM4M = LSCLayout(
    name="PCQM4M", folder="pcqm4m_kddcup2021",
    split_sizes={"train": 3_045_360, "valid": 380_670, "test": 377_423},
    url="https://dgl-data.s3-accelerate.amazonaws.com/dataset/OGB-LSC/pcqm4m_kddcup2021.zip",
    ogb_dataset="PygPCQM4MDataset", ogb_evaluator="PCQM4MEvaluator")
PCQM4MV2 = LSCLayout(
    name="PCQM4Mv2", folder="pcqm4m-v2",
    split_sizes={"train": 3_378_606, "valid": 73_545, "test-dev": 147_037, "test-challenge": 147_432},
    url="https://dgl-data.s3-accelerate.amazonaws.com/dataset/OGB-LSC/pcqm4m-v2.zip",
    ogb_dataset="PygPCQM4Mv2Dataset", ogb_evaluator="PCQM4Mv2Evaluator")
#: ``graphormer-urpe-submit --dataset`` names.
LAYOUTS = {"pcqm4m": PCQM4M, "pcqm4mv2": PCQM4MV2}

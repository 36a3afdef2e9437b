"""The PCQM4Mv2 slice as a plain property CSV: ``smiles`` (hydrogens removed) and ``gap`` (the
HOMO-LUMO gap in eV), for ``scripts/bench_small_data.py --csv`` and ``fit --config csv``.

The slice (``pcqm4mv2/pcqm4mv2_first2k_3d.csv.gz`` of the local data copies) holds explicit-H
CXSMILES with 3D coordinates; RDKit parses each one and writes its canonical SMILES without
hydrogens (``Chem.RemoveHs`` keeps only those that fix a double bond's geometry, in 75 of the
1,999), in the slice's order.

    python scripts/pcqm4mv2_gap_csv.py OUT.csv [--source FILE]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd
from rdkit import Chem, RDLogger

from graphormer_urpe.data.local_data import PCQM4MV2_SLICE, local_data_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--source", type=Path, default=local_data_dir() / PCQM4MV2_SLICE)
    args = parser.parse_args()
    RDLogger.DisableLog("rdApp.*")
    source = pd.read_csv(args.source)
    smiles = []
    for line, cxsmiles in enumerate(source["smiles"], start=2):
        mol = Chem.MolFromSmiles(cxsmiles)
        if mol is None:
            raise SystemExit(f"{args.source}: line {line}: RDKit cannot parse the SMILES")
        smiles.append(Chem.MolToSmiles(Chem.RemoveHs(mol)))
    pd.DataFrame({"smiles": smiles, "gap": source["homo"]}).to_csv(args.out, index=False)
    print(f"{args.out}: {len(smiles)} molecules")


if __name__ == "__main__":
    main()

"""scripts/pcqm4mv2_gap_csv.py on the real PCQM4Mv2 slice: one row per molecule in the slice's
order, hydrogens removed, the gap column the slice's target, and a CSV that the csv recipe's data
module reads as it is."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
from rdkit import Chem

REPO = Path(__file__).resolve().parents[1]


def test_the_slice_as_a_property_csv(pcqm_source, tmp_path):
    out = tmp_path / "gap.csv"
    done = subprocess.run([sys.executable, "scripts/pcqm4mv2_gap_csv.py", str(out), "--source", str(pcqm_source)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    source = pd.read_csv(pcqm_source)
    table = pd.read_csv(out)
    assert list(table.columns) == ["smiles", "gap"] and len(table) == len(source) == 1999
    np.testing.assert_array_equal(table["gap"].to_numpy(), source["homo"].to_numpy())
    assert abs(table["gap"][0] - 3.0476751256) < 1e-9  # PCQM4Mv2 idx 0, as the data's README says
    for row in (0, 1, 25, 1998):  # row 25 keeps the H that fixes its imine's geometry
        written = Chem.MolFromSmiles(table["smiles"][row])
        explicit = Chem.MolFromSmiles(source["smiles"][row], sanitize=False)
        original = Chem.RemoveHs(Chem.MolFromSmiles(source["smiles"][row]))
        assert Chem.MolToSmiles(written) == Chem.MolToSmiles(original)
        assert written.GetNumAtoms() == original.GetNumAtoms() < explicit.GetNumAtoms()
    hydrogens = [sum(atom.GetAtomicNum() == 1 for atom in Chem.MolFromSmiles(s).GetAtoms()) for s in table["smiles"]]
    assert hydrogens[0] == 0 and hydrogens[25] == 1 and sum(h > 0 for h in hydrogens) < 100


def test_a_molecule_rdkit_cannot_parse_is_named_by_its_line(tmp_path):
    source = tmp_path / "slice.csv"
    source.write_text("smiles,homo\nCCO,3.5\nC1CC,4.0\n")
    done = subprocess.run([sys.executable, "scripts/pcqm4mv2_gap_csv.py", str(tmp_path / "out.csv"),
                           "--source", str(source)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == f"{source}: line 3: RDKit cannot parse the SMILES"
    assert not (tmp_path / "out.csv").exists()

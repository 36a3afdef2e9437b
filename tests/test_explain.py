"""graphormer-urpe-explain on real ZINC and ESOL molecules: the atoms' contributions add up to the
output's change from the baseline (integrated gradients' completeness, to 1 %), the output is the
prediction graphormer-urpe-predict gives, and the installed command writes a picture per molecule,
the table and the page, naming each molecule it cannot explain."""
from __future__ import annotations

import csv
import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from graphormer_urpe.data.facts import DataFacts
from graphormer_urpe.data.feature_ids import num_embeddings
from graphormer_urpe.data.featurize import featurizer_spec
from graphormer_urpe.cli.explain import COLUMNS
from graphormer_urpe.prediction.explain import Explanation, explain_smiles
from graphormer_urpe.prediction.load import load_module
from graphormer_urpe.training.module import GraphormerModule

TINY = {"num_layers": 2, "hidden_dim": 16, "ffn_dim": 16, "num_heads": 2}
EXPLAIN = str(Path(sys.executable).with_name("graphormer-urpe-explain"))
PREDICT = str(Path(sys.executable).with_name("graphormer-urpe-predict"))


def checkpoint(path: Path, featurizer: str, task: str = "regression", num_targets: int = 1, seed: int = 0) -> Path:
    """A small model with URPE's C away from 1 and a head 100 times the initial one (so its
    outputs move well above float32 rounding between atoms), saved as a training checkpoint."""
    spec = featurizer_spec(featurizer)
    torch.manual_seed(seed)
    module = GraphormerModule(DataFacts(num_atom_embeddings=num_embeddings(spec.atom_feature_dims),
                                        num_bond_embeddings=num_embeddings(spec.bond_feature_dims),
                                        featurizer=featurizer, task=task, num_targets=num_targets),
                              backbone=TINY)
    with torch.no_grad():
        for scale in module.model.urpe_scales:
            scale.delta.uniform_(-0.5, 0.5)
        module.model.head.weight.mul_(100.0)
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}, path)
    return path


def zinc_smiles(zinc_source: Path, count: int) -> list[str]:
    with gzip.open(zinc_source / "jtvae_test.smi.gz", "rt") as handle:
        return [line.strip() for _, line in zip(range(count), handle)]


def esol_smiles(esol_csv: Path, count: int) -> list[str]:
    with open(esol_csv, newline="") as handle:
        return [row["smiles"] for _, row in zip(range(count), csv.DictReader(handle))]


@pytest.mark.parametrize("featurizer", ["zinc", "ogb"])
def test_contributions_add_up_to_the_change_from_the_baseline(featurizer, zinc_source, esol_csv, tmp_path):
    module = load_module(checkpoint(tmp_path / "m.ckpt", featurizer))
    smiles = zinc_smiles(zinc_source, 12) if featurizer == "zinc" else esol_smiles(esol_csv, 12)
    results = explain_smiles(module, smiles, steps=32)
    assert all(isinstance(r, Explanation) for r in results)
    from rdkit import Chem

    checked = 0
    for text, result in zip(smiles, results):
        assert len(result.atoms) == Chem.MolFromSmiles(text).GetNumAtoms()
        change = result.output - result.baseline
        assert abs(result.gap) <= 0.01 * abs(change) + 1e-6, (text, result.gap, change)
        checked += abs(change) > 1e-2  # a change well above float32 rounding
    assert checked >= 8
    # batched with other molecules or alone: the same explanation
    alone = explain_smiles(module, smiles[3:4], steps=32)[0]
    np.testing.assert_allclose(alone.atoms, results[3].atoms, rtol=1e-4, atol=1e-6)


def test_the_command_writes_pictures_table_and_page(zinc_source, tmp_path):
    ckpt = checkpoint(tmp_path / "m.ckpt", "zinc")
    smiles = zinc_smiles(zinc_source, 4)
    source = tmp_path / "in.csv"
    rows = [("id", "SMILES")] + [(f"m{i}", s) for i, s in enumerate(smiles[:2])] + [("bad", "C1CC")] + \
        [(f"m{i}", s) for i, s in enumerate(smiles[2:], 2)]
    source.write_text("".join(f"{a},{b}\n" for a, b in rows))
    out = tmp_path / "explained"
    done = subprocess.run([EXPLAIN, "--ckpt", str(ckpt), "--input", str(source), "--out", str(out), "--quiet"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    with open(out / "attributions.csv", newline="") as handle:
        table = list(csv.DictReader(handle))
    assert list(table[0]) == COLUMNS and [r["row"] for r in table] == ["1", "2", "3", "4", "5"]
    assert table[2]["error"] == "RDKit cannot parse SMILES 'C1CC'" and not table[2]["atoms"]
    assert not (out / "3.png").exists()
    predicted = tmp_path / "pred.csv"
    assert subprocess.run([PREDICT, "--ckpt", str(ckpt), "--input", str(source), "--output", str(predicted),
                           "--quiet", "--workers", "0"], capture_output=True, timeout=300).returncode == 0
    with open(predicted, newline="") as handle:
        predictions = [row["prediction"] for row in csv.DictReader(handle)]
    for row, prediction in zip(table, predictions):
        if row["error"]:
            continue
        assert (out / f"{row['row']}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (out / f"{row['row']}.svg").read_text().lstrip().startswith("<?xml")
        assert float(row["prediction"]) == pytest.approx(float(prediction), rel=1e-4, abs=1e-5)
        atoms = json.loads(row["atoms"])
        assert abs(float(row["gap"])) <= 0.01 * abs(float(row["output"]) - float(row["baseline"]))
        assert sum(atoms) == pytest.approx(float(row["output"]) - float(row["baseline"]), rel=0.01, abs=1e-4)
    page = (out / "index.html").read_text()
    assert page.count("<figure>") == 5 and "RDKit cannot parse SMILES" in page and 'src="5.svg"' in page


def test_classification_explains_the_logit_and_reports_the_probability(esol_csv, tmp_path):
    module = load_module(checkpoint(tmp_path / "m.ckpt", "ogb", task="multiclass", num_targets=3))
    (result,) = explain_smiles(module, esol_smiles(esol_csv, 1), target=2)
    assert 0 < result.prediction < 1 and result.prediction != result.output
    with pytest.raises(ValueError, match="--target 3: the model has 3 outputs"):
        explain_smiles(module, ["CCO"], target=3)


def test_bad_arguments_are_one_line_before_any_work(tmp_path):
    ckpt = checkpoint(tmp_path / "m.ckpt", "zinc")
    (tmp_path / "in.smi").write_text("CCO\n")
    (tmp_path / "file").write_text("x")
    cases = [
        (["--input", str(tmp_path / "missing.smi"), "--out", str(tmp_path / "o")], "missing.smi does not exist"),
        (["--input", str(tmp_path), "--out", str(tmp_path / "o")], "is a directory"),
        (["--input", str(tmp_path / "in.smi"), "--out", str(tmp_path / "file")], "is a file, not a directory"),
        (["--input", str(tmp_path / "in.smi"), "--out", str(tmp_path / "o"), "--target", "1"],
         "--target 1: the model has 1 outputs"),
    ]
    for arguments, message in cases:
        done = subprocess.run([EXPLAIN, "--ckpt", str(ckpt), *arguments, "--quiet"], capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 2 and message in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_the_attention_view_is_the_graph_tokens_row_of_the_last_layer(zinc_source, tmp_path):
    """``view="attention"``: per atom, the last layer's attention from the graph token, averaged
    over heads, after URPE's C (recomputed here from that layer's own inputs); the output is the
    one the gradients view explains; with C = 1 (plain softmax) the atoms' weights add up to 1
    minus the token's weight on itself."""
    module = load_module(checkpoint(tmp_path / "m.ckpt", "zinc"))
    smiles = zinc_smiles(zinc_source, 6)
    attention = explain_smiles(module, smiles, view="attention")
    gradients = explain_smiles(module, smiles, steps=4)
    from rdkit import Chem

    for text, seen, explained in zip(smiles, attention, gradients):
        assert len(seen.atoms) == Chem.MolFromSmiles(text).GetNumAtoms()
        assert (seen.atoms >= 0).all() and np.isnan(seen.baseline)
        assert seen.output == pytest.approx(explained.output, rel=1e-5, abs=1e-6)
    # The same row recomputed from the inputs the last layer's attention receives.
    layer = module.model.layers[-1].attn
    inputs = []
    hook = layer.register_forward_pre_hook(lambda _, args: inputs.append(args))
    try:
        explain_smiles(module, smiles[:1], view="attention")
    finally:
        hook.remove()
    with torch.no_grad():
        _, weights = layer(*inputs[0][:4], need_weights=True)
    np.testing.assert_allclose(attention[0].atoms, weights[0, :, 0, 1:].mean(0)[:len(attention[0].atoms)].double().numpy(),
                               rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        for scale in module.model.urpe_scales:
            scale.delta.zero_()
    inputs.clear()
    hook = layer.register_forward_pre_hook(lambda _, args: inputs.append(args))
    try:
        (one,) = explain_smiles(module, smiles[:1], view="attention")
    finally:
        hook.remove()
    with torch.no_grad():
        _, plain = layer(*inputs[0][:4], need_weights=True)
    token_on_itself = float(plain[0, :, 0, 0].mean())
    assert one.atoms.sum() == pytest.approx(1 - token_on_itself, rel=1e-4)


def test_the_command_draws_the_attention_view(zinc_source, tmp_path):
    ckpt = checkpoint(tmp_path / "m.ckpt", "zinc")
    source = tmp_path / "in.smi"
    source.write_text("\n".join(zinc_smiles(zinc_source, 3)) + "\n")
    out = tmp_path / "attention"
    done = subprocess.run([EXPLAIN, "--ckpt", str(ckpt), "--input", str(source), "--out", str(out), "--quiet",
                           "--view", "attention"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    with open(out / "attributions.csv", newline="") as handle:
        table = list(csv.DictReader(handle))
    assert len(table) == 3 and all(not r["error"] and not r["baseline"] and not r["gap"] for r in table)
    assert all(min(json.loads(r["atoms"])) >= 0 for r in table)
    assert all((out / f"{n}.png").stat().st_size > 1000 for n in (1, 2, 3))
    assert "Graph-token attention" in (out / "index.html").read_text()


def test_several_checkpoints_explain_their_mean_prediction_with_its_std(zinc_source, tmp_path):
    """``--ckpt A B`` (the installed command, real ZINC molecules): the mean of the two models'
    attributions, which adds up to the change of their mean output (to 1 %), the prediction and
    ``std`` that graphormer-urpe-predict gives for the same two checkpoints, ``std`` on the page;
    a checkpoint of another featurizer is refused in one line."""
    ckpts = [str(checkpoint(tmp_path / f"m{seed}.ckpt", "zinc", seed=seed)) for seed in (0, 1)]
    source = tmp_path / "in.smi"
    source.write_text("\n".join(zinc_smiles(zinc_source, 4)) + "\n")
    out = tmp_path / "explained"
    done = subprocess.run([EXPLAIN, "--ckpt", *ckpts, "--input", str(source), "--out", str(out), "--quiet"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    with open(out / "attributions.csv", newline="") as handle:
        table = list(csv.DictReader(handle))
    assert list(table[0]) == [*COLUMNS[:3], "std", *COLUMNS[3:]]
    predicted = tmp_path / "pred.csv"
    assert subprocess.run([PREDICT, "--ckpt", *ckpts, "--input", str(source), "--output", str(predicted),
                           "--quiet", "--workers", "0"], capture_output=True, timeout=300).returncode == 0
    with open(predicted, newline="") as handle:
        predictions = list(csv.DictReader(handle))
    moved = 0
    for row, predicted_row in zip(table, predictions):
        assert float(row["prediction"]) == pytest.approx(float(predicted_row["prediction"]), rel=1e-4, abs=1e-5)
        assert float(row["std"]) == pytest.approx(float(predicted_row["std"]), rel=1e-3, abs=1e-5)
        change = float(row["output"]) - float(row["baseline"])
        assert abs(sum(json.loads(row["atoms"])) - change) <= 0.01 * abs(change) + 1e-4
        moved += float(row["std"]) > 0
    assert moved == len(table)
    assert " ± " in (out / "index.html").read_text()

    other = checkpoint(tmp_path / "ogb.ckpt", "ogb")
    refused = subprocess.run([EXPLAIN, "--ckpt", ckpts[0], str(other), "--input", str(source), "--out",
                              str(tmp_path / "refused"), "--quiet"], capture_output=True, text=True, timeout=300)
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert refused.returncode == 2 and len(lines) == 1 and "cannot join an ensemble" in lines[0], refused.stderr
    assert not (tmp_path / "refused").exists()


def run_explain(*args, code: str | None = None) -> subprocess.CompletedProcess:
    """The installed command (``code``: run first in a Python process that then runs it, e.g. a
    patch that fills the disk)."""
    command = [EXPLAIN] if code is None else [
        sys.executable, "-c", f"{code}\nimport sys\nfrom graphormer_urpe.cli.explain import main\nsys.exit(main())"]
    return subprocess.run([*command, *map(str, args), "--quiet"], capture_output=True, text=True, timeout=300)


def test_an_out_that_holds_an_input_is_refused(esol_csv, tmp_path):
    """``--input OUT/attributions.csv --out OUT`` (a previous run's table read again) and a
    checkpoint kept in ``--out`` under a name the command writes: one line, exit status 2,
    before any work, the file unchanged."""
    out = tmp_path / "out"
    out.mkdir()
    table = out / "attributions.csv"
    table.write_text("smiles\n" + "\n".join(esol_smiles(esol_csv, 3)) + "\n")
    ckpt = checkpoint(out / "index.html", "ogb")
    before = table.read_bytes(), ckpt.read_bytes()
    for source, message in ((table, f"--out {table} is the input file {table} (--input)"),
                            (tmp_path / "in.csv", f"--out {ckpt} is the checkpoint {ckpt} (--ckpt)")):
        if not source.exists():
            source.write_bytes(before[0])
        done = run_explain("--ckpt", ckpt, "--input", source, "--out", out)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and message in lines[0], done.stderr[-3000:]
        assert (table.read_bytes(), ckpt.read_bytes()) == before
        assert sorted(p.name for p in out.iterdir()) == ["attributions.csv", "index.html"]


def test_an_out_that_cannot_be_written_or_fills_the_disk_is_one_line(esol_csv, tmp_path):
    """An ``--out`` under a regular file (no folder can be made there, even by root) is refused
    in one line before any work (exit status 2); a disk that fills up after two pictures ends in
    one line with exit status 1, those pictures whole, a previous table as it was and no
    temporary file."""
    ckpt = checkpoint(tmp_path / "m.ckpt", "ogb")
    source = tmp_path / "in.smi"
    source.write_text("\n".join(esol_smiles(esol_csv, 4)) + "\n")
    (tmp_path / "file").write_text("x")
    done = run_explain("--ckpt", ckpt, "--input", source, "--out", tmp_path / "file" / "out")
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"graphormer-urpe-explain: error: --out {tmp_path / 'file' / 'out'} cannot be written (Not a directory)"]

    out = tmp_path / "out"
    out.mkdir()
    (out / "attributions.csv").write_text("a previous table\n")
    fill = ("import errno\nfrom graphormer_urpe.utils import files\ncommit = files.commit_together\n"
            "def commit_until_full(outputs):\n"
            "    files.room = getattr(files, 'room', 2)\n"
            "    if files.room == 0:\n"
            "        raise OSError(errno.ENOSPC, 'No space left on device')\n"
            "    files.room -= 1\n"
            "    commit(outputs)\n"
            "files.commit_together = commit_until_full")
    done = run_explain("--ckpt", ckpt, "--input", source, "--out", out, code=fill)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("graphormer-urpe-explain: error: [Errno 28] No space left on device")
    assert sorted(p.name for p in out.iterdir()) == ["1.png", "1.svg", "attributions.csv"]
    assert (out / "1.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "attributions.csv").read_text() == "a previous table\n"

"""graphormer-urpe-predict --embeddings / --atom-embeddings, through the installed command on
real ESOL rows: one row per input row in input order, the vectors the output head reads (the
head applied to them gives the predictions), NaN where a molecule cannot be read, the same from
a checkpoint, a run directory and ``pretrained:zinc-descriptors``, whole or nothing on a
failure, and bad outputs refused in one line (exit 2)."""
from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from graphormer_urpe.prediction.pretrained import resolve
from graphormer_urpe.prediction.load import load_module
from graphormer_urpe.prediction.model import chunk_batches, featurize_rows

PREDICT = Path(sys.executable).with_name("graphormer-urpe-predict")
PRETRAINED = "pretrained:zinc-descriptors"
UNREADABLE = "C1CC(N"  # an unclosed ring and branch: RDKit rejects it
ROWS = 30
BAD_ROW = 7  # 0-based data row replaced by UNREADABLE


def run(*args, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([str(PREDICT), "--quiet", *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if check:
        assert done.returncode == 0, done.stderr
    return done


@pytest.fixture(scope="module")
def molecules(esol_csv, tmp_path_factory) -> Path:
    """The first ESOL rows (all their columns), one SMILES made unreadable."""
    with open(esol_csv, newline="") as handle:
        rows = list(csv.reader(handle))[:ROWS + 1]
    column = [c.lower() for c in rows[0]].index("smiles")
    rows[BAD_ROW + 1][column] = UNREADABLE
    path = tmp_path_factory.mktemp("embeddings") / "esol_head.csv"
    with open(path, "w", newline="") as handle:
        csv.writer(handle).writerows(rows)
    return path


def smiles_of(path: Path) -> list[str]:
    with open(path, newline="") as handle:
        return [row["smiles"] for row in csv.DictReader(handle)]


@pytest.fixture(scope="module")
def written(molecules) -> dict:
    """Predictions and both embeddings from the shipped backbone: small chunks in two workers,
    so rows cross chunks and come back from other processes."""
    out = molecules.parent / "pretrained"
    out.mkdir()
    run("--ckpt", PRETRAINED, "--input", molecules, "--output", out / "preds.csv", "--embeddings",
        out / "graph.npy", "--atom-embeddings", out / "atoms.npz", "--workers", 2, "--chunk-rows", 8)
    return {"dir": out, "graph": np.load(out / "graph.npy"), "atoms": dict(np.load(out / "atoms.npz")),
            "table": list(csv.DictReader(open(out / "preds.csv", newline="")))}


@pytest.fixture(scope="module")
def backbone():
    return load_module(resolve(PRETRAINED))


def alone(module, smiles: str):
    """``smiles`` featurized and encoded as a batch of its own (no padding, no neighbours)."""
    chunk = featurize_rows(module.facts, [smiles], 512)
    (_, batch), = chunk_batches(module.facts, chunk, 1 << 16, 1)
    return batch


def test_one_row_per_input_row_in_order_nan_where_unreadable(written, molecules, backbone):
    graph, atoms, table = written["graph"], written["atoms"], written["table"]
    smiles = smiles_of(molecules)
    assert graph.dtype == np.float32 and graph.shape == (ROWS, 192) == (len(table), backbone.model.config.hidden_dim)
    assert np.isnan(graph[BAD_ROW]).all() and table[BAD_ROW]["error"]
    assert np.isfinite(np.delete(graph, BAD_ROW, 0)).all()
    offsets = atoms["offsets"]
    assert offsets.dtype == np.int64 and offsets.shape == (ROWS + 1,) and offsets[0] == 0
    assert atoms["embeddings"].dtype == np.float32 and atoms["embeddings"].shape == (offsets[-1], 192)
    from rdkit import Chem

    counts = np.diff(offsets)
    assert counts[BAD_ROW] == 0
    assert [int(c) for k, c in enumerate(counts) if k != BAD_ROW] == [
        Chem.MolFromSmiles(s).GetNumAtoms() for k, s in enumerate(smiles) if k != BAD_ROW]
    with torch.inference_mode():  # each molecule alone, in this process: same vectors, same rows
        for k, s in enumerate(smiles):
            if k == BAD_ROW:
                continue
            mine, mine_atoms = backbone.model.embed_atoms(alone(backbone, s))
            np.testing.assert_allclose(graph[k], mine[0].numpy(), atol=2e-5, rtol=1e-4)
            np.testing.assert_allclose(atoms["embeddings"][offsets[k]:offsets[k + 1]], mine_atoms[0].numpy(),
                                       atol=2e-5, rtol=1e-4)
            assert torch.equal(backbone.model.embed(alone(backbone, s)), mine)


def test_the_head_applied_to_the_embedding_gives_the_prediction(written, backbone, molecules):
    graph, table = written["graph"], written["table"]
    columns = [c for c in table[0] if c.startswith("prediction_")]
    assert len(columns) == backbone.facts.num_targets == 206
    predicted = np.array([[float(r[c]) if r[c] else np.nan for c in columns] for r in table])
    with torch.inference_mode():
        head = backbone.model.head(torch.from_numpy(graph)).numpy()
        batch = alone(backbone, smiles_of(molecules)[0])
        assert torch.equal(backbone.model(batch), backbone.model.head(backbone.model.embed(batch)))
    assert np.isnan(head[BAD_ROW]).all() and np.isnan(predicted[BAD_ROW]).all()
    np.testing.assert_allclose(np.delete(predicted, BAD_ROW, 0), np.delete(head, BAD_ROW, 0), rtol=1e-5, atol=1e-5)


def test_a_checkpoint_and_a_run_directory_give_the_same_embeddings(written, molecules, tmp_path):
    """The shipped backbone saved as a Lightning checkpoint, and as a run directory's best one."""
    shipped = torch.load(resolve(PRETRAINED), weights_only=True)
    checkpoint = {"state_dict": {f"model.{k}": v for k, v in shipped["state_dict"].items()},
                  "hyper_parameters": shipped["hyper_parameters"], "global_step": 7}
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    best = run_dir / "checkpoints" / "epoch=0-step=7.ckpt"
    torch.save(checkpoint, best)
    torch.save({**checkpoint, "callbacks": {"ModelCheckpoint{'monitor': 'val/mae'}": {
        "monitor": "val/mae", "best_model_path": str(best), "best_model_score": 0.1}}},
        run_dir / "checkpoints" / "last.ckpt")
    for name, ckpt in (("ckpt", best), ("run", run_dir)):
        run("--ckpt", ckpt, "--input", molecules, "--output", tmp_path / f"{name}.csv",
            "--embeddings", tmp_path / f"{name}.npy", "--workers", 0)
        np.testing.assert_array_equal(np.load(tmp_path / f"{name}.npy"), written["graph"])


def test_a_failure_leaves_previous_embeddings_whole(esol_csv, tmp_path):
    """Invalid UTF-8 after 300 ESOL rows, read past the first text buffer (so after several
    chunks were embedded): exit 2, and the previous .npy and .npz stay as they were, with no
    temporary file beside them."""
    broken = tmp_path / "broken.csv"
    lines = esol_csv.read_bytes().splitlines(keepends=True)[:301]
    assert sum(map(len, lines)) > 3 * 8192  # past the text buffer: the error comes mid-stream
    broken.write_bytes(b"".join(lines) + b"\xff\xfe,not UTF-8\n")
    previous = {name: tmp_path / name for name in ("graph.npy", "atoms.npz", "preds.csv")}
    for path in previous.values():
        path.write_bytes(b"previous " + path.name.encode())
    done = run("--ckpt", PRETRAINED, "--input", broken, "--output", previous["preds.csv"],
               "--embeddings", previous["graph.npy"], "--atom-embeddings", previous["atoms.npz"],
               "--chunk-rows", 32, "--workers", 0, check=False)
    assert done.returncode == 2 and "nothing written" in done.stderr, done.stderr
    for path in previous.values():
        assert path.read_bytes() == b"previous " + path.name.encode()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["broken.csv", *previous])


PREVIOUS_RUN = {"preds.csv": "row,smiles,prediction,error\n1,CCO,-0.5,\n2,CCC,-1.0,\n3,CCN,-0.2,\n"}


def write_previous_run(folder: Path) -> dict[str, bytes]:
    """A previous run's outputs in ``folder``: a 3-row table and its embeddings (3 vectors, 3
    molecules' atoms); returns their bytes."""
    (folder / "preds.csv").write_text(PREVIOUS_RUN["preds.csv"])
    np.save(folder / "graph.npy", np.ones((3, 4), dtype=np.float32))
    np.savez(folder / "atoms.npz", embeddings=np.ones((9, 4), dtype=np.float32), offsets=np.array([0, 3, 6, 9]))
    return {name: (folder / name).read_bytes() for name in ("preds.csv", "graph.npy", "atoms.npz")}


def outputs_args(folder: Path) -> list:
    return ["--output", folder / "preds.csv", "--embeddings", folder / "graph.npy",
            "--atom-embeddings", folder / "atoms.npz"]


def test_a_disk_that_fills_while_the_npz_is_assembled_keeps_every_previous_file(written, molecules, tmp_path):
    """A real disk (a tmpfs) with room for the run's table, both embeddings' streamed vectors and
    the assembled .npy, but only half of the .npz: one line, exit 1, and the previous table and
    both embeddings byte for byte (a new .npy of this run's rows once stood beside the old
    table), no temporary file left."""
    from helpers.small_disk import pages, small_disk

    new = {name: (written["dir"] / name).stat().st_size for name in ("preds.csv", "graph.npy", "atoms.npz")}
    (tmp_path / "measured").mkdir()
    previous_room = sum(pages(len(b)) for b in write_previous_run(tmp_path / "measured").values())
    # the table, the vectors streamed to unnamed temporaries (as large as the arrays), the .npy
    # assembled, half the .npz
    room = (previous_room + pages(new["preds.csv"]) + 2 * pages(new["graph.npy"]) + pages(new["atoms.npz"])
            + new["atoms.npz"] // 2)
    with small_disk(tmp_path / "full", room) as disk:
        before = write_previous_run(disk)
        done = run("--ckpt", PRETRAINED, "--input", molecules, *outputs_args(disk), "--workers", 1,
                   "--chunk-rows", 8, check=False)
        assert done.returncode == 1, done.stderr
        assert done.stderr.strip().splitlines()[-1].endswith("No space left on device; nothing written")
        assert "Traceback" not in done.stderr
        assert {name: (disk / name).read_bytes() for name in before} == before
        assert sorted(p.name for p in disk.iterdir()) == sorted(before)


def test_a_disk_that_fills_while_the_npy_is_assembled_says_so_in_one_line(written, molecules, tmp_path):
    """A real disk (a tmpfs) with room for the table and the streamed vectors but only half the
    assembled .npy: one line naming the full disk (ENOSPC), exit 1, the previous files byte for
    byte, no temporary file left."""
    from helpers.small_disk import pages, small_disk

    new = {name: (written["dir"] / name).stat().st_size for name in ("preds.csv", "graph.npy")}
    (tmp_path / "measured").mkdir()
    previous_room = sum(pages(len(b)) for b in write_previous_run(tmp_path / "measured").values())
    room = previous_room + pages(new["preds.csv"]) + pages(new["graph.npy"]) + new["graph.npy"] // 2
    with small_disk(tmp_path / "full", room) as disk:
        before = write_previous_run(disk)
        done = run("--ckpt", PRETRAINED, "--input", molecules, "--output", disk / "preds.csv",
                   "--embeddings", disk / "graph.npy", "--workers", 0, check=False)
        assert done.returncode == 1, done.stderr
        assert done.stderr.strip().splitlines()[-1].endswith("No space left on device; nothing written"), done.stderr
        assert "Traceback" not in done.stderr
        assert {name: (disk / name).read_bytes() for name in before} == before
        assert sorted(p.name for p in disk.iterdir()) == sorted(before)


def test_a_failure_after_the_npy_is_assembled_keeps_every_previous_file(molecules, tmp_path, monkeypatch, capsys):
    """The same in this process, on any machine: the disk fills while the .npz's offsets are
    written, after the .npy was assembled."""
    import errno

    from graphormer_urpe.cli.predict import main

    write_array = np.lib.format.write_array

    def full(handle, array, *args, **kwargs):
        if array.dtype == np.int64:  # the offsets, the .npz's last member
            raise OSError(errno.ENOSPC, "No space left on device")
        return write_array(handle, array, *args, **kwargs)

    before = write_previous_run(tmp_path)
    monkeypatch.setattr(np.lib.format, "write_array", full)
    status = main(["--quiet", "--ckpt", PRETRAINED, "--input", str(molecules),
                   *map(str, outputs_args(tmp_path)), "--workers", "0"])
    assert status == 1
    assert capsys.readouterr().err.strip().endswith("No space left on device; nothing written")
    assert {name: (tmp_path / name).read_bytes() for name in before} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(before)


def test_bad_outputs_are_refused_in_one_line(molecules, tmp_path):
    """Each refused before the model is loaded: one line, exit 2, nothing written."""
    smiles_file = tmp_path / "mols.npy"  # one SMILES a line, whatever its name
    smiles_file.write_text("\n".join(smiles_of(molecules)[:3]) + "\n")
    model_file = tmp_path / "model.npy"  # a checkpoint, whatever its name
    model_file.write_bytes(resolve(PRETRAINED).read_bytes())
    (tmp_path / "folder.npy").mkdir()
    base = ["--input", molecules, "--output", tmp_path / "out.csv"]
    cases = {
        "is the input file": ["--ckpt", PRETRAINED, "--input", smiles_file, "--output", tmp_path / "o.csv",
                              "--embeddings", smiles_file],
        "is the checkpoint": ["--ckpt", model_file, *base, "--embeddings", model_file],
        "is the prediction table": ["--ckpt", PRETRAINED, "--input", molecules, "--output", tmp_path / "t.npy",
                                    "--embeddings", tmp_path / "t.npy"],
        "is a directory": ["--ckpt", PRETRAINED, *base, "--embeddings", tmp_path / "folder.npy"],
        "cannot be written": ["--ckpt", PRETRAINED, *base, "--embeddings", molecules / "e.npy"],
        "must end in .npy": ["--ckpt", PRETRAINED, *base, "--embeddings", tmp_path / "e.npz"],
        "must end in .npz": ["--ckpt", PRETRAINED, *base, "--atom-embeddings", tmp_path / "a.npy"],
        "come from one model": ["--ckpt", PRETRAINED, *base, "--mc-dropout", 4, "--embeddings", tmp_path / "e.npy"],
    }
    before = sorted(p.name for p in tmp_path.iterdir())
    started = {why: subprocess.Popen([str(PREDICT), "--quiet", *map(str, args)], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
               for why, args in cases.items()}
    for why, process in started.items():
        out, err = process.communicate(timeout=300)
        errors = [line for line in err.splitlines() if line.startswith("graphormer-urpe-predict: error:")]
        assert process.returncode == 2 and len(errors) == 1 and why in errors[0], (why, err)
        assert "Traceback" not in err and not out
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written, no temporary left
    assert smiles_file.read_text().count("\n") == 3 and model_file.stat().st_size == resolve(PRETRAINED).stat().st_size


def test_a_model_reading_token_and_sum_writes_that_readout_and_its_atoms(molecules, tmp_path):
    """A ``readout: token+sum`` checkpoint (the shipped backbone with a head twice as wide): each
    molecule's vector is the graph token's beside its atoms' sum (2D wide), the atoms' file keeps
    D, and the head applied to the vector gives the prediction."""
    shipped = torch.load(resolve(PRETRAINED), weights_only=True)
    hparams = {**shipped["hyper_parameters"],
               "backbone": {**shipped["hyper_parameters"]["backbone"], "readout": "token+sum"}}
    width = hparams["backbone"]["hidden_dim"]
    head = torch.nn.Linear(2 * width, 1)
    state = {**{f"model.{k}": v for k, v in shipped["state_dict"].items() if not k.startswith("head.")},
             "model.head.weight": head.weight.detach(), "model.head.bias": head.bias.detach()}
    hparams["facts"] = {**hparams["facts"], "num_targets": 1}
    hparams["target_names"] = ["y"]
    checkpoint = tmp_path / "token_sum.ckpt"
    torch.save({"state_dict": state, "hyper_parameters": hparams, "global_step": 1}, checkpoint)
    run("--ckpt", checkpoint, "--input", molecules, "--output", tmp_path / "preds.csv",
        "--embeddings", tmp_path / "graph.npy", "--atom-embeddings", tmp_path / "atoms.npz", "--workers", 0)
    graph, atoms = np.load(tmp_path / "graph.npy"), dict(np.load(tmp_path / "atoms.npz"))
    assert graph.shape == (ROWS, 2 * width) and atoms["embeddings"].shape[1] == width
    offsets = atoms["offsets"]
    for k in range(ROWS):
        if k != BAD_ROW:
            np.testing.assert_allclose(graph[k, width:], atoms["embeddings"][offsets[k]:offsets[k + 1]].sum(0),
                                       rtol=1e-4, atol=1e-4)
    table = list(csv.DictReader(open(tmp_path / "preds.csv", newline="")))
    predicted = np.array([float(r["prediction_y"]) for k, r in enumerate(table) if k != BAD_ROW])
    with torch.inference_mode():
        expected = head(torch.from_numpy(np.delete(graph, BAD_ROW, 0))).numpy()[:, 0]
    np.testing.assert_allclose(predicted, expected, rtol=1e-5, atol=1e-5)

"""graphormer-urpe-predict: checkpoints trained through the CLI on the real ESOL CSV and on ZINC
predict SMILES exactly as the data pipeline does, keep input order and the input's columns,
refuse damaged checkpoints and dangerous outputs, and report bad rows."""
from __future__ import annotations

import csv
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from graphormer_urpe.utils.torch_files import read_checkpoint
from graphormer_urpe.cli.predict import main as predict_main
from graphormer_urpe.prediction.load import best_checkpoint, load_module, model_checkpoint_state
from graphormer_urpe.prediction.run import Streaming, stream
from graphormer_urpe.prediction.table import InputRow, PredictionTable, SmilesInput
from graphormer_urpe.training.lightning_cli import build_cli

REPO = Path(__file__).resolve().parents[1]
PREDICT = Path(sys.executable).with_name("graphormer-urpe-predict")
TINY_BACKBONE = {"num_layers": 2, "hidden_dim": 16, "ffn_dim": 16, "num_heads": 2}
ESOL_TARGET = "measured log solubility in mols per litre"


@pytest.fixture(scope="module")
def esol_run(esol_csv, tmp_path_factory):
    """A tiny URPE model fitted for 3 steps on ESOL by the CLI, and its DataModule."""
    work = tmp_path_factory.mktemp("esol")
    cli = build_cli([
        "fit", "--config", str(REPO / "configs" / "esol.yaml"),
        "--trainer.default_root_dir", str(work / "run"),
        "--trainer.max_steps", "3", "--trainer.limit_val_batches", "1", "--trainer.val_check_interval", "3",
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        "--model.backbone", json.dumps(TINY_BACKBONE), "--model.warmup_steps", "1",
        "--data.init_args.path", str(esol_csv),
        "--data.init_args.cache_root", str(work / "cache"),
    ])
    return cli, work / "run" / "checkpoints" / "last.ckpt"


@pytest.fixture(scope="module")
def zinc_ckpt(zinc_root, tmp_path_factory) -> Path:
    """A tiny URPE model fitted for 2 steps on ZINC-12k (the ``zinc`` featurizer) by the CLI."""
    work = tmp_path_factory.mktemp("zinc")
    (work / "data").mkdir()
    (work / "data" / "ZINC").symlink_to(zinc_root, target_is_directory=True)
    build_cli([
        "fit", "--config", str(REPO / "configs" / "zinc.yaml"),
        "--trainer.default_root_dir", str(work / "run"), "--trainer.precision", "32-true",
        "--trainer.max_steps", "2", "--trainer.limit_val_batches", "1",
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        "--model.backbone", json.dumps(TINY_BACKBONE), "--model.warmup_steps", "1",
        "--data.init_args.root", str(work / "data"),
    ])
    return work / "run" / "checkpoints" / "last.ckpt"


@pytest.fixture(scope="module")
def zinc_smiles(zinc_source) -> list[str]:
    import gzip

    with gzip.open(zinc_source / "jtvae_test.smi.gz", "rt") as handle:
        return [line.strip() for line in handle][:300]


def read_output(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def read_csv_column(path: Path, column: str) -> list[str]:
    with open(path, newline="") as handle:
        return [row[column] for row in csv.DictReader(handle)]


def run(ckpt: Path, source: Path, output: Path, *extra: str) -> int:
    return predict_main(["--ckpt", str(ckpt), "--input", str(source), "--output", str(output),
                         "--quiet", *extra])


def test_predictions_match_the_data_pipeline_and_keep_input_order_and_columns(esol_run, tmp_path):
    cli, ckpt = esol_run
    data = cli.datamodule
    test_rows = data.store()[3]["test"]
    smiles = read_csv_column(data.path, "smiles")
    expected = torch.cat([out["prediction"] for out in cli.trainer.predict(
        cli.model, datamodule=data, ckpt_path=str(ckpt))]).squeeze(1).numpy()

    inputs = [smiles[r] for r in test_rows]
    mixed = ["C1CC", inputs[0], "", "not a molecule", *inputs[1:]]
    source = tmp_path / "in.csv"
    with open(source, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["name", "SMILES", "error"])
        writer.writerows([[f"m{i}", s, f"note {i}"] for i, s in enumerate(mixed)])
    # chunks of 7 rows and batches of at most 3 molecules: order must survive both
    assert run(ckpt, source, tmp_path / "out.csv", "--chunk-rows", "7", "--batch-size", "3") == 0

    rows = read_output(tmp_path / "out.csv")
    prediction = f"prediction_{ESOL_TARGET}"  # named by the checkpoint's target column
    assert list(rows[0]) == ["row", "name", "SMILES", "input_error", prediction, "error"]
    assert [r["SMILES"] for r in rows] == mixed
    assert [r["name"] for r in rows] == [f"m{i}" for i in range(len(mixed))]
    assert [r["input_error"] for r in rows] == [f"note {i}" for i in range(len(mixed))]
    assert [int(r["row"]) for r in rows] == list(range(1, len(mixed) + 1))
    for bad in (0, 2, 3):
        assert rows[bad][prediction] == "" and rows[bad]["error"]
    assert "cannot parse" in rows[0]["error"] and rows[2]["error"] == "empty SMILES"
    got = np.array([float(r[prediction]) for i, r in enumerate(rows) if i not in (0, 2, 3)])
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_plain_smiles_file_of_any_extension_with_bom_and_crlf(esol_run, tmp_path):
    _, ckpt = esol_run
    for name in ("in.smi", "in.csv", "in.txt"):
        source = tmp_path / name
        source.write_bytes("\ufeffCCO\r\nCCCCCCCCCCCCCCCCCCCC\r\nc1ccccc1\r\n".encode())
        assert run(ckpt, source, tmp_path / "out.csv", "--max-nodes", "10") == 0
        raw = (tmp_path / "out.csv").read_bytes()
        assert b"\r" not in raw and not raw.startswith(b"\xef\xbb\xbf")
        rows = read_output(tmp_path / "out.csv")
        assert [r["smiles"] for r in rows] == ["CCO", "CCCCCCCCCCCCCCCCCCCC", "c1ccccc1"], name
        assert rows[0][f"prediction_{ESOL_TARGET}"] and rows[2][f"prediction_{ESOL_TARGET}"]
        assert "20 atoms, more than max_nodes=10" in rows[1]["error"]


def test_csv_with_bom_keeps_its_smiles_column(esol_run, tmp_path):
    _, ckpt = esol_run
    source = tmp_path / "in.csv"
    source.write_bytes("\ufeffsmiles,id\nCCO,a\nc1ccccc1,b\n".encode())
    assert run(ckpt, source, tmp_path / "out.csv") == 0
    rows = read_output(tmp_path / "out.csv")
    assert [(r["smiles"], r["id"], r["error"]) for r in rows] == [("CCO", "a", ""), ("c1ccccc1", "b", "")]


def test_smiles_with_white_space_inside_are_error_rows(esol_run, tmp_path):
    # RDKit reads only up to the first white space: these would have been predicted as CCO.
    _, ckpt = esol_run
    source = tmp_path / "in.csv"
    with open(source, "w", newline="") as handle:
        csv.writer(handle).writerows([["smiles"], ["CCO extra words"], ["CC\nO"], ["CCO"], ["CCO\tx"]])
    assert run(ckpt, source, tmp_path / "out.csv") == 0
    rows = read_output(tmp_path / "out.csv")
    assert [r["smiles"] for r in rows] == ["CCO extra words", "CC\nO", "CCO", "CCO\tx"]
    for bad in (0, 1, 3):
        assert rows[bad][f"prediction_{ESOL_TARGET}"] == "" and "white space" in rows[bad]["error"]
    assert rows[2][f"prediction_{ESOL_TARGET}"] and not rows[2]["error"]


def test_smiles_with_a_non_ascii_character_are_error_rows(esol_run, tmp_path):
    # RDKit parses "CCÖ" as CC, silently dropping the Ö.
    _, ckpt = esol_run
    source = tmp_path / "in.smi"
    source.write_text("CC\u00d6\nCCO\nC\u00e9C\n", encoding="utf-8")
    done = subprocess.run([str(PREDICT), "--ckpt", str(ckpt), "--input", str(source), "--output",
                           str(tmp_path / "out.csv"), "--quiet"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = read_output(tmp_path / "out.csv")
    assert [r["smiles"] for r in rows] == ["CC\u00d6", "CCO", "C\u00e9C"]
    assert rows[0]["error"] == "SMILES 'CC\u00d6' has a character that is not ASCII ('\u00d6' at position 3); " \
                               "RDKit would drop it or misread the molecule"
    assert rows[0][f"prediction_{ESOL_TARGET}"] == rows[2][f"prediction_{ESOL_TARGET}"] == ""
    assert "not ASCII" in rows[2]["error"] and rows[1][f"prediction_{ESOL_TARGET}"] and not rows[1]["error"]


def test_charge_outside_the_zinc_vocabulary_is_an_error_row(zinc_ckpt, zinc_smiles, tmp_path):
    source = tmp_path / "in.smi"
    source.write_text("\n".join(["C[S-2]", "C[S-]", "C[N+2]", *zinc_smiles[:20]]) + "\n")
    assert run(zinc_ckpt, source, tmp_path / "out.csv") == 0
    rows = read_output(tmp_path / "out.csv")
    assert rows[0]["prediction"] == "" and "'S -2'" in rows[0]["error"]
    assert rows[1]["prediction"] and not rows[1]["error"]  # a single charge is in the vocabulary
    assert rows[2]["prediction"] == "" and "'N +2'" in rows[2]["error"]
    assert all(r["prediction"] and not r["error"] for r in rows[3:])


@pytest.mark.parametrize("value", ["-1", "0"])
def test_non_positive_batch_size_is_a_usage_error(esol_run, tmp_path, capsys, value):
    _, ckpt = esol_run
    source = tmp_path / "in.smi"
    source.write_text("CCO\n")
    with pytest.raises(SystemExit) as exit_info:
        run(ckpt, source, tmp_path / "out.csv", "--batch-size", value)
    assert exit_info.value.code == 2 and "--batch-size: must be >= 1, got" in capsys.readouterr().err
    assert not (tmp_path / "out.csv").exists()


# ------------------------------------------------------------------------------- data loss
@pytest.mark.parametrize("spelling", ["same", "dotted", "symlink", "hardlink"])
def test_output_that_is_the_input_is_refused(esol_run, tmp_path, capsys, spelling):
    _, ckpt = esol_run
    (tmp_path / "sub").mkdir()
    source = tmp_path / "in.csv"
    content = "id,smiles\na,CCO\n"
    source.write_text(content)
    output = {"same": source, "dotted": tmp_path / "sub" / ".." / "in.csv",
              "symlink": tmp_path / "link.csv", "hardlink": tmp_path / "hard.csv"}[spelling]
    if spelling == "symlink":
        output.symlink_to(source)
    elif spelling == "hardlink":
        os.link(source, output)
    assert run(ckpt, source, output) == 2
    assert "is the input file" in capsys.readouterr().err
    assert source.read_text() == content
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


@pytest.mark.parametrize("spelling", ["same", "symlink", "hardlink"])
def test_output_that_is_the_checkpoint_is_refused(esol_run, tmp_path, spelling):
    """Through the installed command: ``--output`` naming the checkpoint (or a link to it) is
    refused in one line with exit status 2, and the model's bytes are unchanged."""
    _, trained = esol_run
    ckpt = tmp_path / "model.ckpt"
    shutil.copyfile(trained, ckpt)
    before = hashlib.sha256(ckpt.read_bytes()).hexdigest()
    source = tmp_path / "in.smi"
    source.write_text("CCO\nc1ccccc1\n")
    output = {"same": ckpt, "symlink": tmp_path / "link.ckpt", "hardlink": tmp_path / "hard.ckpt"}[spelling]
    if spelling == "symlink":
        output.symlink_to(ckpt)
    elif spelling == "hardlink":
        os.link(ckpt, output)
    done = subprocess.run([str(Path(sys.executable).parent / "graphormer-urpe-predict"), "--ckpt", str(ckpt),
                           "--input", str(source), "--output", str(output), "--quiet"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines() == [
        f"graphormer-urpe-predict: error: --output {output} is the checkpoint {ckpt} (--ckpt): it would "
        "be overwritten; choose another output"]
    assert hashlib.sha256(ckpt.read_bytes()).hexdigest() == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


@pytest.mark.parametrize("kind", ["directory", "fifo", "-", "/dev/stdin"])
def test_input_that_is_not_a_regular_file_is_named_for_what_it_is(esol_run, tmp_path, kind):
    """Not "does not exist" for a folder, a pipe or standard input: one line saying what it is."""
    _, ckpt = esol_run
    source = {"directory": tmp_path / "folder", "fifo": tmp_path / "pipe", "-": Path("-"),
              "/dev/stdin": Path("/dev/stdin")}[kind]
    if kind == "directory":
        source.mkdir()
    elif kind == "fifo":
        os.mkfifo(source)
    done = subprocess.run([str(PREDICT), "--ckpt", str(ckpt), "--input", str(source), "--output",
                           str(tmp_path / "out.csv")], stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    what = {"directory": "is a directory", "fifo": "is a FIFO (named pipe), not a regular file",
            "-": "is '-', but standard input is not read: give a file",
            "/dev/stdin": "is a character device, not a regular file"}[kind]  # stdin is /dev/null here
    assert done.stderr.strip().splitlines() == [f"graphormer-urpe-predict: error: --input {source} {what}"]
    assert not (tmp_path / "out.csv").exists()


def test_unwritable_output_fails_before_any_work(tmp_path, capsys):
    source = tmp_path / "in.smi"
    source.write_text("CCO\n")
    (tmp_path / "file").write_text("")
    # The checkpoint does not even exist: the output is checked first.
    assert run(tmp_path / "missing.ckpt", source, tmp_path / "file" / "out.csv") == 2
    assert "file" in capsys.readouterr().err


def test_failure_mid_write_keeps_the_previous_output(esol_run, tmp_path, monkeypatch, capsys):
    _, ckpt = esol_run
    source = tmp_path / "in.smi"
    source.write_text("CCO\nCCN\nCCC\nCCCl\n")
    output = tmp_path / "out.csv"
    output.write_text("previous results\n")
    real_write = PredictionTable.write
    calls = []

    def write_then_fill_the_disk(self, rows, predictions):
        calls.append(len(rows))
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real_write(self, rows, predictions)

    monkeypatch.setattr(PredictionTable, "write", write_then_fill_the_disk)
    assert run(ckpt, source, output, "--chunk-rows", "2", "--workers", "0") == 1
    assert "No space left" in capsys.readouterr().err
    assert output.read_text() == "previous results\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.smi", "out.csv"]  # no temporary left


def test_new_output_gets_ordinary_permissions(esol_run, tmp_path):
    _, ckpt = esol_run
    source = tmp_path / "in.smi"
    source.write_text("CCO\n")
    umask = os.umask(0o022)
    try:
        assert run(ckpt, source, tmp_path / "out.csv") == 0
    finally:
        os.umask(umask)
    assert (tmp_path / "out.csv").stat().st_mode & 0o777 == 0o644


# Standard output as /dev/fd/1, not /dev/stdout: a regression that replaces the file would
# replace the machine's /dev/stdout; /dev/fd is /proc, where no file can be created.
@pytest.mark.parametrize("kind", ["symlink", "dangling symlink", "fifo", "character device", "/dev/fd/1"])
def test_output_that_is_not_a_regular_file_is_written_through_never_replaced(esol_run, tmp_path, kind):
    """``--output`` naming a symbolic link writes its target (the link stays); a FIFO, a device
    (as /dev/null is) or standard output is written in place, never replaced by a regular file."""
    import stat
    import threading

    _, ckpt = esol_run
    source = tmp_path / "in.smi"
    source.write_text("CCO\nc1ccccc1\n")
    output, target = tmp_path / "out.csv", tmp_path / "target.csv"
    received: list[str] = []
    reader = None
    if kind == "symlink":
        target.write_text("old predictions\n")
        output.symlink_to(target)
    elif kind == "dangling symlink":
        output.symlink_to(target)
    elif kind == "fifo":
        os.mkfifo(output)
        reader = threading.Thread(target=lambda: received.append(output.read_text()), daemon=True)
        reader.start()
    elif kind == "character device":
        try:  # the null device's numbers, in the test's own folder
            os.mknod(output, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        except PermissionError:
            pytest.skip("creating a device file needs root")
    else:
        output = Path(kind)
    done = subprocess.run([str(PREDICT), "--ckpt", str(ckpt), "--input", str(source), "--output",
                           str(output), "--quiet", "--workers", "0"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    if reader is not None:
        reader.join(timeout=60)
    written = {"symlink": lambda: target.read_text(), "dangling symlink": lambda: target.read_text(),
               "fifo": lambda: received[0], "character device": lambda: "",
               "/dev/fd/1": lambda: done.stdout}[kind]()
    if kind != "character device":
        lines = written.splitlines()
        assert lines[0].startswith("row,smiles,prediction") and len(lines) == 3, written
    if kind.endswith("symlink"):
        assert output.is_symlink() and os.readlink(output) == str(target)
    elif kind == "fifo":
        assert stat.S_ISFIFO(os.lstat(output).st_mode)
    elif kind == "character device":
        assert stat.S_ISCHR(os.lstat(output).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temporary


# ------------------------------------------------------------------------------ checkpoints
def _overwrite_entry_bytes(ckpt: Path, bad: Path) -> None:
    """A copy of ``ckpt`` with bytes of its largest tensor entry changed in place (CRC stale)."""
    data = bytearray(ckpt.read_bytes())
    with zipfile.ZipFile(ckpt) as archive:
        info = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    # local header: 30 bytes + name + extra, then the stored (uncompressed) bytes
    name_len = int.from_bytes(data[info.header_offset + 26:info.header_offset + 28], "little")
    extra_len = int.from_bytes(data[info.header_offset + 28:info.header_offset + 30], "little")
    start = info.header_offset + 30 + name_len + extra_len
    data[start:start + 8] = np.array([1.5, -2.5], dtype=np.float32).tobytes()
    bad.write_bytes(bytes(data))


PROBLEMS = {
    "missing": "does not exist",
    "corrupt": "cannot be read",
    "truncated": "cannot be read",
    "crc": "fails the CRC check",
    "nan": "non-finite weights",
    "incompatible": "does not match",
    "edited heads": "does not match",
    "edited featurizer": "does not match",
    "edited task": "does not match",
    "edited max_hops": "does not match",
    "urpe C stored as weight": "Unexpected key(s) in state_dict: \"model.urpe_scales.0.weight\"",
    "foreign": "not a Lightning checkpoint",
    "code": "other than tensors and plain values",
}


@pytest.mark.parametrize("problem", list(PROBLEMS))
def test_bad_checkpoints_get_a_clear_error(esol_run, tmp_path, capsys, problem):
    _, ckpt = esol_run
    bad = tmp_path / "bad.ckpt"
    checkpoint = torch.load(ckpt, weights_only=False)
    hparams = checkpoint["hyper_parameters"]
    if problem == "missing":
        pass
    elif problem == "corrupt":
        bad.write_bytes(b"definitely not a checkpoint")
    elif problem == "truncated":
        bad.write_bytes(ckpt.read_bytes()[:4096])
    elif problem == "crc":
        _overwrite_entry_bytes(ckpt, bad)
    elif problem == "foreign":
        torch.save({"weights": torch.zeros(3)}, bad)
    elif problem == "code":
        torch.save({"state_dict": {}, "hyper_parameters": {}, "x": zipfile.ZipInfo("a")}, bad)
    else:
        if problem == "nan":
            name = next(k for k, v in checkpoint["state_dict"].items() if v.is_floating_point())
            checkpoint["state_dict"][name].view(-1)[0] = float("nan")
        elif problem == "incompatible":  # weights of another architecture under these hyperparameters
            hparams["backbone"] = {**TINY_BACKBONE, "hidden_dim": 32}
        elif problem == "edited heads":  # 16 is not divisible by 3
            hparams["backbone"] = {**TINY_BACKBONE, "num_heads": 3}
        elif problem == "edited featurizer":
            hparams["facts"]["featurizer"] = "zinc"
        elif problem == "edited task":
            hparams["facts"]["task"] = "ranking"
        elif problem == "edited max_hops":
            hparams["facts"]["max_hops"] = "five"
        elif problem == "urpe C stored as weight":  # the layout before C was stored as delta = C - 1
            checkpoint["state_dict"] = {
                (k.removesuffix("delta") + "weight" if ".urpe_scales." in k else k): v
                for k, v in checkpoint["state_dict"].items()}
        torch.save(checkpoint, bad)
    source = tmp_path / "in.smi"
    source.write_text("CCO\n")
    code = run(bad, source, tmp_path / "o.csv")
    assert code == 2
    message = capsys.readouterr().err
    assert str(bad) in message and PROBLEMS[problem] in message
    assert "weights_only" not in message and "Traceback" not in message
    assert not (tmp_path / "o.csv").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_csv_without_smiles_column_is_an_error(esol_run, tmp_path, capsys):
    _, ckpt = esol_run
    source = tmp_path / "in.csv"
    source.write_text("name,formula\nethanol,C2H6O\n")
    assert run(ckpt, source, tmp_path / "o.csv") == 2
    assert "no 'smiles' column" in capsys.readouterr().err
    assert not (tmp_path / "o.csv").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_a_clear_error(esol_run, tmp_path, capsys):
    _, ckpt = esol_run
    source = tmp_path / "in.smi"
    source.write_text("CCO\n")
    assert run(ckpt, source, tmp_path / "o.csv", "--device", "cuda") == 2
    assert "CUDA is not available" in capsys.readouterr().err


# ------------------------------------------------------------------------- memory and speed
def test_batches_respect_the_pair_budget_and_give_the_same_predictions(zinc_ckpt, zinc_smiles,
                                                                        tmp_path, monkeypatch):
    source = tmp_path / "in.smi"
    source.write_text("\n".join(zinc_smiles) + "\n")
    assert run(zinc_ckpt, source, tmp_path / "default.csv") == 0
    shapes = []
    from graphormer_urpe.prediction.model import PredictionModel

    forward = PredictionModel.forward

    def recording_forward(self, batch):
        shapes.append((batch.num_graphs, int(batch.num_nodes.max())))
        return forward(self, batch)

    monkeypatch.setattr(PredictionModel, "forward", recording_forward)
    budget = 20_000
    assert run(zinc_ckpt, source, tmp_path / "budget.csv", "--max-pairs", str(budget), "--workers", "0") == 0
    shapes = shapes[1:]  # the first forward is the load-time check of the model
    assert sum(b for b, _ in shapes) == len(zinc_smiles)
    assert all(b * (n + 1) ** 2 <= budget for b, n in shapes), max(b * (n + 1) ** 2 for b, n in shapes)
    assert len(shapes) >= 5  # without the budget: one batch (300 rows < --batch-size, one chunk)
    default, budgeted = read_output(tmp_path / "default.csv"), read_output(tmp_path / "budget.csv")
    assert [r["smiles"] for r in budgeted] == zinc_smiles
    np.testing.assert_allclose([float(r["prediction"]) for r in budgeted],
                               [float(r["prediction"]) for r in default], rtol=1e-5, atol=1e-6)


def test_a_molecule_larger_than_the_budget_is_predicted_alone(zinc_ckpt, zinc_smiles, tmp_path):
    source = tmp_path / "in.smi"
    source.write_text("\n".join(zinc_smiles[:5]) + "\n")
    assert run(zinc_ckpt, source, tmp_path / "out.csv", "--max-pairs", "1") == 0
    assert all(r["prediction"] for r in read_output(tmp_path / "out.csv"))


def test_input_is_streamed_in_bounded_chunks(zinc_ckpt, zinc_smiles):
    module = load_module(zinc_ckpt)
    read = []

    def rows():
        for i in range(10 ** 9):  # practically endless: must never be read to the end
            read.append(i)
            yield InputRow(zinc_smiles[i % len(zinc_smiles)])

    class Enough(Exception):
        pass

    written = []

    def write(chunk, output):
        assert np.isfinite(output.predictions).all()
        written.append(len(read))
        if len(written) == 2:
            raise Enough

    with pytest.raises(Enough):
        stream(module, SmilesInput(None, None, rows(), 10 ** 9), Streaming(512, 1 << 16, 64, 50, workers=1, quiet=True),
               "predict", write)
    # one worker: at most 2 chunks ahead of the one being written
    assert written[0] <= 50 * 4


def test_installed_command_shows_progress(esol_run, tmp_path):
    _, ckpt = esol_run
    source = tmp_path / "in.smi"
    source.write_text("CCO\nc1ccccc1\n")
    done = subprocess.run([str(Path(sys.executable).parent / "graphormer-urpe-predict"), "--ckpt", str(ckpt),
                           "--input", str(source), "--output", str(tmp_path / "out.csv")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "2/2" in done.stderr and "mol/s" in done.stderr
    assert len(read_output(tmp_path / "out.csv")) == 2
    helped = subprocess.run([str(Path(sys.executable).parent / "graphormer-urpe-predict"), "--help"],
                            capture_output=True, text=True, timeout=300)
    assert "--max-pairs" in helped.stdout and "Peak memory" in helped.stdout


def test_several_checkpoints_predict_their_mean_with_a_std_column(esol_run, esol_csv, zinc_ckpt, tmp_path, capsys):
    """``--ckpt A B`` (the installed command, real ESOL molecules): the prediction column is the
    two models' mean and ``std_<target>`` their standard deviation, each model as predicted alone;
    a folder of their run directories predicts as their best checkpoints; models of another task are refused in one line, before any work."""
    _, first = esol_run
    work = tmp_path / "seed1"
    build_cli([
        "fit", "--config", str(REPO / "configs" / "esol.yaml"), "--seed_everything", "1",
        "--trainer.default_root_dir", str(work / "run"),
        "--trainer.max_steps", "3", "--trainer.limit_val_batches", "1", "--trainer.val_check_interval", "3",
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        "--model.backbone", json.dumps(TINY_BACKBONE), "--model.warmup_steps", "1",
        "--data.init_args.path", str(esol_csv), "--data.init_args.cache_root", str(work / "cache"),
    ])
    second = work / "run" / "checkpoints" / "last.ckpt"
    source = tmp_path / "mols.csv"
    source.write_text("".join(open(esol_csv).readlines()[:81]))  # header and 80 molecules
    done = subprocess.run([str(PREDICT), "--ckpt", str(first), str(second), "--input", str(source),
                           "--output", str(tmp_path / "both.csv"), "--quiet"],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    both = read_output(tmp_path / "both.csv")
    alone = []
    for ckpt in (first, second):
        assert predict_main(["--ckpt", str(ckpt), "--input", str(source), "--output",
                             str(tmp_path / "alone.csv"), "--quiet", "--workers", "0"]) == 0
        alone.append(np.array([float(r[f"prediction_{ESOL_TARGET}"]) for r in read_output(tmp_path / "alone.csv")]))
    mean = np.array([float(r[f"prediction_{ESOL_TARGET}"]) for r in both])
    std = np.array([float(r[f"std_{ESOL_TARGET}"]) for r in both])
    assert len(both) == 80 and list(both[0])[-1] == "error" and not any(r["error"] for r in both)
    np.testing.assert_allclose(mean, (alone[0] + alone[1]) / 2, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(std, np.abs(alone[0] - alone[1]) / 2, rtol=1e-4, atol=1e-5)
    assert std.max() > 0

    # A folder of run directories (copied elsewhere) stands for each run's best checkpoint.
    runs = tmp_path / "runs"
    for name, ckpt in (("a", first), ("b", second)):
        shutil.copytree(ckpt.parents[1], runs / name)
    best = [best_checkpoint(runs / name)[0] for name in ("a", "b")]
    assert [path.parents[1] for path in best] == [runs / "a", runs / "b"]
    for option, output in ((["--ckpt", str(runs)], "folder.csv"), (["--ckpt", *map(str, best)], "files.csv")):
        assert predict_main([*option, "--input", str(source), "--output", str(tmp_path / output),
                             "--quiet", "--workers", "0"]) == 0
    assert read_output(tmp_path / "folder.csv") == read_output(tmp_path / "files.csv")
    assert predict_main(["--ckpt", str(tmp_path / "seed1" / "cache"), "--input", str(source), "--output",
                         str(tmp_path / "none.csv")]) == 2
    assert "neither a run directory" in capsys.readouterr().err and not (tmp_path / "none.csv").exists()

    refused = subprocess.run([str(PREDICT), "--ckpt", str(first), str(zinc_ckpt), "--input", str(source),
                              "--output", str(tmp_path / "mixed.csv")],
                             capture_output=True, text=True, stdin=subprocess.DEVNULL)
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr
    assert f"{zinc_ckpt} cannot join an ensemble with {first}: other data facts" in lines[0]
    assert not (tmp_path / "mixed.csv").exists()


def test_mc_dropout_predicts_a_mean_and_std_from_one_checkpoint(esol_run, esol_csv, tmp_path, run_main):
    """``--mc-dropout N`` (real ESOL molecules; the installed command with 0 and 2 worker
    processes, its ``main()`` in this process for the rest): a std column that is positive, the
    same file whatever the number of processes and for the same seed, another for another seed;
    a model without dropout, and several checkpoints, are refused in one line."""
    _, ckpt = esol_run
    source = tmp_path / "mols.csv"
    source.write_text("".join(open(esol_csv).readlines()[:41]))  # header and 40 molecules
    options = lambda out, *extra: ["--input", str(source), "--output", str(tmp_path / out), "--quiet", *extra]

    def predict(out: str, *extra: str) -> None:
        done = subprocess.run([str(PREDICT), *options(out, *extra)], capture_output=True, text=True,
                              stdin=subprocess.DEVNULL)
        assert done.returncode == 0, done.stderr

    def predict_here(out: str, *extra: str) -> subprocess.CompletedProcess:
        return run_main(predict_main, options(out, *extra))

    assert predict_here("plain.csv", "--ckpt", str(ckpt), "--workers", "0").returncode == 0
    predict("mc.csv", "--ckpt", str(ckpt), "--mc-dropout", "8", "--workers", "0")
    predict("mc2.csv", "--ckpt", str(ckpt), "--mc-dropout", "8", "--workers", "2")
    for out, seed in (("here.csv", "0"), ("other.csv", "1")):  # in this process, seed 0 and 1
        assert predict_here(out, "--ckpt", str(ckpt), "--mc-dropout", "8", "--seed", seed, "--workers", "0").returncode == 0
    plain, mc = read_output(tmp_path / "plain.csv"), read_output(tmp_path / "mc.csv")
    column = f"prediction_{ESOL_TARGET}"
    assert list(mc[0]) == [*plain[0]][:-1] + [f"std_{ESOL_TARGET}", "error"]
    std = np.array([float(r[f"std_{ESOL_TARGET}"]) for r in mc])
    assert len(mc) == 40 and (std > 0).all()
    deterministic = np.array([float(r[column]) for r in plain])
    sampled = np.array([float(r[column]) for r in mc])
    assert not np.allclose(sampled, deterministic) and np.abs(sampled - deterministic).max() < 10 * std.max()
    assert (tmp_path / "mc2.csv").read_text() == (tmp_path / "mc.csv").read_text()
    assert (tmp_path / "here.csv").read_text() == (tmp_path / "mc.csv").read_text()
    assert (tmp_path / "other.csv").read_text() != (tmp_path / "here.csv").read_text()

    saved = torch.load(ckpt, map_location="cpu", weights_only=True)
    for key in ("dropout", "attention_dropout", "activation_dropout"):
        saved["hyper_parameters"]["backbone"][key] = 0.0
    torch.save(saved, tmp_path / "no_dropout.ckpt")
    copy = tmp_path / "copy.ckpt"
    shutil.copyfile(ckpt, copy)
    for extra, message in ((["--ckpt", str(tmp_path / "no_dropout.ckpt")], "trained without dropout"),
                           (["--ckpt", str(ckpt), str(copy)], "--mc-dropout takes one checkpoint")):
        refused = predict_here("refused.csv", *extra, "--mc-dropout", "4")
        lines = [line for line in refused.stderr.splitlines() if line.strip()]
        assert refused.returncode == 2 and len(lines) == 1 and message in lines[0], refused.stderr
        assert not (tmp_path / "refused.csv").exists()


def test_evaluate_scores_predictions_and_their_std_against_measured_values(esol_run, esol_csv, tmp_path, run_main):
    """``--evaluate COLUMN`` (the installed command, real ESOL molecules): one JSON line whose
    errors and uncertainty scores equal those computed here from the written file; a missing
    column, a plain SMILES list or the wrong number of columns is refused in one line."""
    from scipy.stats import norm, spearmanr

    _, ckpt = esol_run
    source = tmp_path / "mols.csv"
    source.write_text("".join(open(esol_csv).readlines()[:61]))  # header and 60 molecules

    def predict(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(PREDICT), "--ckpt", str(ckpt), "--input", str(source), "--output",
                               str(tmp_path / "out.csv"), "--quiet", "--workers", "0", *extra],
                              capture_output=True, text=True, stdin=subprocess.DEVNULL)

    done = predict("--mc-dropout", "8", "--evaluate", ESOL_TARGET)
    assert done.returncode == 0, done.stderr
    scores = json.loads(done.stdout.strip().splitlines()[-1])
    rows = read_output(tmp_path / "out.csv")
    measured = np.array([float(r[ESOL_TARGET]) for r in rows])
    mean = np.array([float(r[f"prediction_{ESOL_TARGET}"]) for r in rows])
    std = np.array([float(r[f"std_{ESOL_TARGET}"]) for r in rows])
    error = mean - measured
    assert (scores["prediction"], scores["measured"], scores["molecules"]) == \
        (f"prediction_{ESOL_TARGET}", ESOL_TARGET, 60)
    assert scores["rmse"] == pytest.approx(np.sqrt(np.mean(error ** 2)))
    assert scores["mae"] == pytest.approx(np.mean(np.abs(error)))
    assert scores["spearman"] == pytest.approx(spearmanr(std, np.abs(error)).statistic)
    assert scores["nll"] == pytest.approx(np.mean(-norm.logpdf(measured, mean, std)), rel=1e-6)
    expected = [p for p in np.linspace(0.01, 0.99, 99)]
    observed = [np.mean((measured >= norm.interval(p, mean, std)[0]) & (measured <= norm.interval(p, mean, std)[1]))
                for p in expected]
    assert scores["miscalibration_area"] == pytest.approx(np.mean(np.abs(np.array(observed) - expected)), abs=1e-9)
    assert scores["within_1_std"] == pytest.approx(np.mean(np.abs(error) <= std))

    # main() of the same command, in this process: no start-up per case
    def predict_here(*extra: str) -> subprocess.CompletedProcess:
        return run_main(predict_main, ["--ckpt", ckpt, "--input", source, "--output", tmp_path / "out.csv",
                                       "--quiet", "--workers", "0", *extra])

    plain = predict_here("--evaluate", ESOL_TARGET)
    assert plain.returncode == 0 and set(json.loads(plain.stdout.strip().splitlines()[-1])) == \
        {"prediction", "measured", "molecules", "rmse", "mae"}

    (tmp_path / "list.smi").write_text("CCO\nc1ccccc1\n")
    (tmp_path / "out.csv").unlink()
    for extra, message in (
            (["--evaluate", "solubility"], "has no column(s) ['solubility']"),
            (["--evaluate", ESOL_TARGET, "smiles"], "one column per target: the model has 1, got 2"),
            (["--evaluate", ESOL_TARGET, "--input", str(tmp_path / "list.smi")],
             "reads measured values from a CSV with a header")):
        refused = predict_here(*extra)
        lines = [line for line in refused.stderr.splitlines() if line.strip()]
        assert refused.returncode == 2 and len(lines) == 1 and message in lines[0], refused.stderr
        assert not (tmp_path / "out.csv").exists()


def test_calibrate_scales_each_std_to_fit_the_errors_of_held_out_molecules(esol_run, esol_csv, tmp_path, capsys):
    """``--calibrate CSV`` (the installed command, real ESOL molecules): the std column is the
    uncalibrated one times the scale fitted on the calibration molecules' errors, which is the
    root mean square of their errors in std units (so there it becomes 1); the predictions are
    unchanged; a model without a std, a CSV without the target's column or without a header is
    refused in one line and nothing is written."""
    _, ckpt = esol_run
    lines = open(esol_csv).readlines()
    source, calibration = tmp_path / "mols.csv", tmp_path / "val.csv"
    source.write_text("".join(lines[:61]))  # header and 60 molecules
    calibration.write_text("".join([lines[0], *lines[61:161]]))  # 100 others

    def predict(out: str, *extra: str, input_: Path = source) -> subprocess.CompletedProcess:
        return subprocess.run([str(PREDICT), "--ckpt", str(ckpt), "--input", str(input_), "--output",
                               str(tmp_path / out), "--quiet", "--workers", "0", *extra],
                              capture_output=True, text=True, stdin=subprocess.DEVNULL)

    mean_column, std_column = f"prediction_{ESOL_TARGET}", f"std_{ESOL_TARGET}"
    for out, input_ in (("raw.csv", source), ("val_raw.csv", calibration)):
        assert predict(out, "--mc-dropout", "8", input_=input_).returncode == 0
    done = predict("out.csv", "--mc-dropout", "8", "--calibrate", str(calibration))
    assert done.returncode == 0, done.stderr
    val = read_output(tmp_path / "val_raw.csv")
    z = np.array([(float(r[mean_column]) - float(r[ESOL_TARGET])) / float(r[std_column]) for r in val])
    scale = float(np.sqrt(np.mean(z ** 2)))
    assert f"{std_column} scaled by {scale:.4g} (fitted on 100 molecules of {calibration})" in done.stderr
    raw, calibrated = read_output(tmp_path / "raw.csv"), read_output(tmp_path / "out.csv")
    assert [r[mean_column] for r in calibrated] == [r[mean_column] for r in raw]
    np.testing.assert_allclose([float(r[std_column]) for r in calibrated],
                               [float(r[std_column]) * scale for r in raw], rtol=1e-5)

    (tmp_path / "list.smi").write_text("CCO\nc1ccccc1\n")
    (tmp_path / "no_target.csv").write_text("smiles,logS\nCCO,1.0\n")
    for extra, message in (  # main() of the same command, in this process: no start-up per case
            (["--calibrate", str(calibration)], "--calibrate scales the std columns"),
            (["--mc-dropout", "4", "--calibrate", str(tmp_path / "no_target.csv")],
             f"has no column(s) ['{ESOL_TARGET}']"),
            (["--mc-dropout", "4", "--calibrate", str(tmp_path / "list.smi")],
             "reads measured values from a CSV with a header")):
        capsys.readouterr()
        status = predict_main(["--ckpt", str(ckpt), "--input", str(source), "--output", str(tmp_path / "refused.csv"),
                               "--quiet", "--workers", "0", *extra])
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert status == 2 and len(lines) == 1 and message in lines[0], lines
        assert not (tmp_path / "refused.csv").exists()


def test_calibrate_and_evaluate_refuse_a_model_that_is_not_regression_before_reading_a_file(tmp_path, run_main):
    """Two classification checkpoints (an ensemble, so they predict a std): ``--calibrate`` and
    ``--evaluate`` compare with measured values, which only a regression model predicts; the
    refusal names the task before any file is read (here a calibration file that is not UTF-8)."""
    from graphormer_urpe.data.facts import DataFacts
    from graphormer_urpe.training.module import GraphormerModule

    ckpts = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        module = GraphormerModule(DataFacts(num_atom_embeddings=29, num_bond_embeddings=5, task="classification"),
                                  backbone={"num_layers": 1, "hidden_dim": 16, "ffn_dim": 16, "num_heads": 2})
        ckpts.append(tmp_path / f"c{seed}.ckpt")
        torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}, ckpts[-1])
    source, unreadable = tmp_path / "in.csv", tmp_path / "latin1.csv"
    source.write_text("smiles,active\nCCO,1\nc1ccccc1,0\n")
    unreadable.write_bytes("smiles,active\nCC\xe9,1\n".encode("latin-1"))
    for extra, option in ((["--calibrate", str(unreadable)], "--calibrate"), (["--evaluate", "active"], "--evaluate")):
        refused = run_main(predict_main, ["--ckpt", *ckpts, "--input", source, "--output", tmp_path / "out.csv",
                                          "--quiet", "--workers", "0", *extra])
        lines = [line for line in refused.stderr.splitlines() if line.strip()]
        assert refused.returncode == 2 and len(lines) == 1, lines
        assert f"{option} compares a regression model's predictions with measured values; " \
               "this model's task is 'classification'" in lines[0]
        assert not (tmp_path / "out.csv").exists()


def installed_predict(*args) -> subprocess.CompletedProcess:
    return subprocess.run([str(PREDICT), *map(str, args), "--quiet"], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})


def assert_one_line(done: subprocess.CompletedProcess, status: int, message: str) -> None:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == status and len(lines) == 1, done.stderr[-3000:]
    assert lines[0].startswith("graphormer-urpe-predict: error: ") and message in lines[0], lines[0]


def test_a_checkpoint_named_twice_is_refused(esol_run, tmp_path):
    """``--ckpt A A``, a link to A beside A, a run directory with its own best checkpoint (the
    installed command, real ESOL molecules): one model twice is no ensemble (its std would be 0
    on every row), refused in one line before any work, nothing written."""
    _, last = esol_run
    run_dir = last.parents[1]
    best = best_checkpoint(run_dir)[0]
    (tmp_path / "link.ckpt").symlink_to(last)
    source = tmp_path / "in.smi"
    source.write_text("CCO\nOc1ccccc1\n")
    for ckpts in ([last, last], [last, tmp_path / "link.ckpt"], [run_dir, best]):
        done = installed_predict("--ckpt", *ckpts, "--input", source, "--output", tmp_path / "out.csv")
        assert_one_line(done, 2, f"are one checkpoint file")
        assert not (tmp_path / "out.csv").exists()


def test_a_copied_run_directory_predicts_with_its_own_best_checkpoint_only(esol_run, tmp_path):
    """A run directory copied elsewhere stands for the best checkpoint inside it; without that
    file it is refused in one line, never predicted with the original run's checkpoint that its
    last.ckpt records."""
    _, last = esol_run
    copy = tmp_path / "copy"
    shutil.copytree(last.parents[1], copy)
    source = tmp_path / "in.smi"
    source.write_text("CCO\nOc1ccccc1\n")
    done = installed_predict("--ckpt", copy, "--input", source, "--output", tmp_path / "out.csv")
    assert done.returncode == 0 and f"models: {best_checkpoint(copy)[0]}" in done.stderr, done.stderr
    assert best_checkpoint(copy)[0].parents[1] == copy
    for best in (copy / "checkpoints").glob("epoch=*.ckpt"):
        best.unlink()
    done = installed_predict("--ckpt", copy, "--input", source, "--output", tmp_path / "missing.csv")
    assert_one_line(done, 2, f"{copy}: its best checkpoint epoch=")
    assert "is missing from" in done.stderr and not (tmp_path / "missing.csv").exists()


def test_a_run_whose_last_checkpoint_records_no_best_is_refused(esol_run, tmp_path):
    """A run directory whose last.ckpt holds no ModelCheckpoint state for the task's metric (a
    run that never validated, here its state removed) is refused in one line by the installed
    command; the state the real run recorded names its best checkpoint."""
    _, last = esol_run
    recorded = model_checkpoint_state(read_checkpoint(last), "val/mae")
    assert Path(recorded["best_model_path"]).name == best_checkpoint(last.parents[1])[0].name
    copy = tmp_path / "copy"
    shutil.copytree(last.parents[1], copy)
    checkpoint = read_checkpoint(copy / "checkpoints" / "last.ckpt")
    checkpoint["callbacks"] = {key: state for key, state in checkpoint["callbacks"].items()
                               if not key.startswith("ModelCheckpoint")}
    torch.save(checkpoint, copy / "checkpoints" / "last.ckpt")
    source = tmp_path / "in.smi"
    source.write_text("CCO\n")
    done = installed_predict("--ckpt", copy, "--input", source, "--output", tmp_path / "out.csv")
    assert_one_line(done, 2, f"{copy}: last.ckpt has no best val/mae checkpoint")
    assert not (tmp_path / "out.csv").exists()


def test_mc_dropout_of_a_molecule_depends_on_it_alone(esol_run, esol_csv, tmp_path):
    """``--mc-dropout`` with one seed (the installed command, real ESOL molecules): phenol's mean
    and std are the same alone, inside a 41-row file, with another ``--batch-size`` and with
    worker processes: its masks come from the seed and the molecule, none from its neighbours."""
    _, ckpt = esol_run
    rows = [row["smiles"] for row in csv.DictReader(open(esol_csv, newline=""))][:40]
    alone, inside = tmp_path / "alone.smi", tmp_path / "inside.smi"
    alone.write_text("Oc1ccccc1\n")
    inside.write_text("\n".join([*rows[:20], "Oc1ccccc1", *rows[20:]]) + "\n")
    results = []
    for source, extra in ((alone, []), (inside, []), (inside, ["--batch-size", "3"]),
                          (inside, ["--batch-size", "7", "--workers", "2"])):
        out = tmp_path / f"out{len(results)}.csv"
        done = installed_predict("--ckpt", ckpt, "--mc-dropout", "8", "--input", source, "--output", out,
                                 "--workers", "0", *extra)
        assert done.returncode == 0, done.stderr[-3000:]
        phenol = [row for row in read_output(out) if row["smiles"] == "Oc1ccccc1"]
        assert len(phenol) == 1
        results.append((phenol[0][f"prediction_{ESOL_TARGET}"], phenol[0][f"std_{ESOL_TARGET}"]))
    assert len(set(results)) == 1 and float(results[0][1]) > 0, results


def test_calibrate_writes_no_temporary_file(esol_run, esol_csv, tmp_path):
    """``--calibrate`` keeps the calibration molecules' predictions in memory: with a temporary
    directory in which nothing can be created (a full disk: every file or folder made there fails
    with ENOSPC) the command predicts as it does elsewhere."""
    _, ckpt = esol_run
    lines = open(esol_csv).readlines()
    source, calibration = tmp_path / "mols.csv", tmp_path / "val.csv"
    source.write_text("".join(lines[:11]))
    calibration.write_text("".join([lines[0], *lines[11:51]]))
    full = ("import errno, tempfile\n"
            "def full_disk(make):\n"
            "    def made(*args, dir=None, **kwargs):\n"
            "        if dir is None:  # in the temporary directory\n"
            "            raise OSError(errno.ENOSPC, 'No space left on device', tempfile.gettempdir())\n"
            "        return make(*args, dir=dir, **kwargs)\n"
            "    return made\n"
            "tempfile.mkstemp, tempfile.mkdtemp = full_disk(tempfile.mkstemp), full_disk(tempfile.mkdtemp)\n"
            "from graphormer_urpe.cli.predict import main\nimport sys\nsys.exit(main())")
    outputs = []
    for name, command in (("here.csv", [str(PREDICT)]), ("full.csv", [sys.executable, "-c", full])):
        done = subprocess.run([*command, "--ckpt", str(ckpt), "--mc-dropout", "4", "--calibrate", str(calibration),
                               "--input", str(source), "--output", str(tmp_path / name), "--quiet", "--workers", "0"],
                              capture_output=True, text=True, stdin=subprocess.DEVNULL)
        assert done.returncode == 0, done.stderr[-3000:]
        outputs.append((tmp_path / name).read_text())
    assert outputs[0] == outputs[1]


def test_a_calibration_file_that_cannot_be_read_or_is_the_output_is_named_as_calibrate(tmp_path, run_main):
    """--calibrate's file is refused under its own option (not as --input), before any work."""
    source = tmp_path / "mols.csv"
    source.write_text("smiles\nCCO\n")
    out = tmp_path / "out.csv"
    missing = tmp_path / "nowhere.csv"
    for calibration, expected in ((missing, f"--calibrate {missing} does not exist"),
                                  (out, f"--output {out} is the calibration file")):
        if calibration == out:
            out.write_text("smiles,logS\nCCO,1.0\n")
        result = run_main(predict_main, ["--ckpt", "pretrained:zinc-descriptors", "--input", str(source),
                                         "--output", str(out), "--calibrate", str(calibration), "--quiet"])
        assert result.returncode == 2 and expected in result.stderr, result.stderr


# ----------------------------------------------- a field too large, memory that runs out
def test_a_field_over_the_csv_limit_is_one_error_row_and_the_others_are_predicted(esol_run, esol_csv, tmp_path):
    """A 2 MB SMILES among ESOL's molecules (the installed command): in a CSV, one error row
    naming its line, its fields left empty (the whole input was refused: "field larger than
    field limit"); as the first line of a one-SMILES-a-line file, the same (a traceback). A
    131,000-carbon chain just under the limit is an error row for its size, counted before it
    is featurized (which took 4 minutes). Every other row has the prediction it gets without
    them."""
    import pandas as pd

    _, ckpt = esol_run
    clean = pd.read_csv(esol_csv).iloc[:12]
    huge, chain = "C" * 2_000_000, "C" * 131_000
    rows = pd.concat([clean.iloc[:5], clean.iloc[[0]].assign(smiles=huge), clean.iloc[5:9],
                      clean.iloc[[0]].assign(smiles=chain), clean.iloc[9:]])
    rows.to_csv(tmp_path / "in.csv", index=False)
    (tmp_path / "in.smi").write_text("\n".join([huge, *clean["smiles"]]) + "\n")
    clean.to_csv(tmp_path / "clean.csv", index=False)
    for name in ("clean", "in"):
        started = time.monotonic()
        done = installed_predict("--ckpt", ckpt, "--input", tmp_path / f"{name}.csv", "--output", tmp_path / f"{name}.out")
        assert done.returncode == 0, done.stderr[-3000:]
    assert time.monotonic() - started < 120  # the chain alone took 4 minutes to featurize
    expected = [row[f"prediction_{ESOL_TARGET}"] for row in read_output(tmp_path / "clean.out")]
    got = read_output(tmp_path / "in.out")
    assert len(got) == 14
    assert got[5]["error"] == "line 7 cannot be read: field larger than field limit (131072)"
    assert not any(got[5][column] for column in clean.columns)
    assert got[10]["error"] == "molecule has 131000 atoms, more than max_nodes=512"
    kept = got[:5] + got[6:10] + got[11:]
    assert [row[f"prediction_{ESOL_TARGET}"] for row in kept] == expected
    assert [row["smiles"] for row in kept] == list(clean["smiles"]) and not any(row["error"] for row in kept)

    done = installed_predict("--ckpt", ckpt, "--input", tmp_path / "in.smi", "--output", tmp_path / "smi.out")
    assert done.returncode == 0, done.stderr[-3000:]
    got = read_output(tmp_path / "smi.out")
    assert got[0]["smiles"] == "" and got[0]["error"] == (
        "line 1 cannot be read: longer than the field limit (131072 characters)")
    assert [row[f"prediction_{ESOL_TARGET}"] for row in got[1:]] == expected


@pytest.mark.parametrize("workers", ["2", "0"])
def test_running_out_of_memory_is_one_line_and_leaves_the_previous_output(esol_csv, tmp_path, workers):
    """The installed command under a 1.1 GiB address-space limit (``prlimit --as``), whose
    batches need more (``--max-pairs 4000000``; ~1.6 GiB per predicting process): whether a
    worker or the command itself runs out, one line saying so and what to lower, exit status
    1, no traceback, the previous output byte for byte and no ``.part`` file left (it was a
    traceback of torch's allocator, or oneDNN's ``could not create a primitive``)."""
    import resource

    output = tmp_path / "out.csv"
    output.write_text("row,smiles,prediction,error\n1,CCO,-0.5,\n")  # a previous run's output
    before = output.read_bytes()

    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (1100 << 20, 1100 << 20))

    done = subprocess.run([str(PREDICT), "--ckpt", "pretrained:zinc-descriptors", "--input", str(esol_csv),
                           "--output", str(output), "--max-pairs", "4000000", "--workers", workers, "--quiet"],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, preexec_fn=limit_memory,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    lower = ("--max-pairs (now 4000000), --batch-size (now 1024) or --workers (now 2)" if workers == "2"
             else "--max-pairs (now 4000000) or --batch-size (now 1024)")
    lines = [line for line in done.stderr.splitlines() if not line.startswith("models: ")]
    assert done.returncode == 1 and len(lines) == 1, done.stderr[-3000:]
    assert lines[0].startswith("graphormer-urpe-predict: error: ran out of memory (") \
        and lines[0].endswith(f"); lower {lower}; nothing written"), lines[0]
    assert output.read_bytes() == before
    assert list(tmp_path.glob(".*.part")) == [] and list(tmp_path.glob("*.part")) == []

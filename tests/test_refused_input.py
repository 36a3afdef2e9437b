"""Bad input through the installed commands on real data (ESOL, ZINC, a PCQM4Mv2 slice): one line
naming the option or file, exit status 2, and every check that needs no data before any data
is read; a huge molecule in a CSV is skipped before it is featurized; a damaged processed file
is rebuilt."""
from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from graphormer_urpe.cli import ablation
from graphormer_urpe.cli import submit
from graphormer_urpe.data.ogb_lsc import PCQM4M, write_root
from graphormer_urpe.cli.fit import main as cli_main

REPO = Path(__file__).resolve().parents[1]
COMMAND = Path(sys.executable).with_name("graphormer-urpe")
TINY = json.dumps({"num_layers": 1, "hidden_dim": 16, "ffn_dim": 16, "num_heads": 2})
ESOL_TARGET = "measured log solubility in mols per litre"


def esol_args(work: Path, csv: Path, *extra: str) -> list[str]:
    return ["fit", "--config", str(REPO / "configs" / "esol.yaml"),
            "--trainer.default_root_dir", str(work / "run"), "--trainer.max_steps", "2",
            "--trainer.limit_val_batches", "1", "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false", "--model.backbone", TINY,
            "--model.warmup_steps", "1", "--model.warmup_fraction", "null", "--data.init_args.path", str(csv),
            "--data.init_args.cache_root", str(work / "cache"), *extra]


def run_command(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    assert COMMAND.is_file(), f"{COMMAND} is not installed (pip install -e .)"
    return subprocess.run([str(COMMAND), *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, **kwargs)


def error_lines(stderr: str) -> list[str]:
    """The error lines of stderr: everything after the notes that precede the error (Lightning's
    seeding note, warnings printed when pytest does not capture them), none a traceback."""
    lines = stderr.strip().splitlines()
    assert not any(line.startswith("Traceback") for line in lines), stderr[-3000:]
    first = next((i for i, line in enumerate(lines) if line.startswith("graphormer-urpe: error: ")),
                 len(lines))
    return lines[first:]


@pytest.fixture(scope="module")
def bad_files(esol_csv, tmp_path_factory) -> dict[str, Path]:
    """Real ESOL content made into the files users get wrong."""
    work = tmp_path_factory.mktemp("bad_files")
    table = pd.read_csv(esol_csv)
    files = {"empty": work / "empty.csv", "header only": work / "header.csv",
             "latin-1": work / "latin1.csv", "multiclass 0/30": work / "classes.csv",
             "target column twice": work / "twice.csv", "directory": work / "folder.csv"}
    files["empty"].write_text("")
    files["header only"].write_text(esol_csv.read_text().splitlines()[0] + "\n")
    latin = table.copy()
    latin.loc[3, "Compound ID"] = "Amigdalin \u00e9ther"
    latin.to_csv(files["latin-1"], index=False, encoding="latin-1")
    classes = table[["smiles"]].copy()
    classes["label"] = [0 if v < -3 else 30 for v in table[ESOL_TARGET]]  # two classes, ids 0, 30
    classes.to_csv(files["multiclass 0/30"], index=False)
    # ESOL's own predictions under the measured column's name: which one would a run train on?
    twice = table.rename(columns={"ESOL predicted log solubility in mols per litre": ESOL_TARGET})
    twice.to_csv(files["target column twice"], index=False)
    files["directory"].mkdir()
    return files


# ------------------------------------------------------------------------ options (item 12)
OPTION_REFUSALS = {
    "--data.init_args.batch_size=0": "batch_size must be >= 1, got 0",
    "--data.init_args.max_hops=0": "max_hops must be >= 1, got 0",
    "--data.init_args.max_nodes=0": "max_nodes must be >= 1, got 0",
    "--data.init_args.bucket_batches=-1": "bucket_batches must be >= 0, got -1",
    "--data.init_args.split_fractions=[0.5,0.2,0.2]":
        r"split_fractions must be three non-negative numbers summing to 1, got \(0.5, 0.2, 0.2\)",
    "--data.init_args.target_columns=[solubility]": r"esol.csv has no target column\(s\) \['solubility'\]",
    "--data.init_args.task=regresion": "task must be one of .*, got 'regresion'",
    "--model.lr=0": r"model.lr must be > 0, got 0.0",
    "--model.end_lr=0.1": r"model.end_lr must be between 0 and model.lr=0.0002 .*, got 0.1",
    "--model.warmup_steps=-1": "model.warmup_steps must be >= 0, got -1",
    "--model.warmup_steps=2": r"model.warmup_steps \(2\) must be below the schedule's total_steps "
                              r"\(2, from trainer.max_steps\)",
    "--data.init_args.max_hops=256": "max_hops must be at most 255, got 256",
    "--data.init_args.seed=-1": r"data.init_args.seed must be an integer from 0 to 4294967295 \(2\*\*32 - 1\), got -1",
    "--seed_everything=4294967296": r"seed_everything must be an integer from 0 to 4294967295 \(2\*\*32 - 1\), "
                                    r"got 4294967296",
    "--trainer.max_steps=0": r"trainer.max_steps must be >= 1, or -1 for no limit, got 0",
}


@pytest.mark.parametrize("option", OPTION_REFUSALS)
def test_bad_option_is_one_line_exit_2_before_any_data_is_read(esol_csv, tmp_path, capsys, option):
    import re

    status = cli_main(esol_args(tmp_path, esol_csv, option))
    lines = error_lines(capsys.readouterr().err)
    assert status == 2
    assert len(lines) == 1 and lines[0].startswith("graphormer-urpe: error: "), lines
    assert re.search(OPTION_REFUSALS[option], lines[0]), lines[0]
    assert not (tmp_path / "cache").exists()  # refused before the CSV was featurized


def test_installed_command_refuses_in_one_line(esol_csv, tmp_path):
    """The jsonargparse-wrapped DataModule error and a seed Lightning would refuse with a
    traceback, through the console script (every other option refusal runs in-process above)."""
    for option, message in (("--data.init_args.batch_size=0", "batch_size must be >= 1, got 0"),
                            ("--seed_everything=-1", "seed_everything must be an integer from 0 to "
                                                     "4294967295 (2**32 - 1), got -1")):
        done = run_command(esol_args(tmp_path, esol_csv, option))
        assert done.returncode == 2, done.stderr[-3000:]
        assert error_lines(done.stderr) == [f"graphormer-urpe: error: {message}"]


def test_schedule_is_checked_before_the_data(tmp_path, capsys):
    """ZINC with an empty data root: a bad schedule is reported without building (or, without
    a source, downloading) the data set."""
    root = tmp_path / "data"
    root.mkdir()
    status = cli_main(["fit", "--config", str(REPO / "configs" / "zinc.yaml"),
                       "--data.init_args.root", str(root), "--trainer.default_root_dir",
                       str(tmp_path / "run"), "--trainer.max_steps", "100",
                       "--model.warmup_steps", "100"])
    assert status == 2
    assert "model.warmup_steps (100) must be below" in capsys.readouterr().err
    assert list(root.iterdir()) == []


# -------------------------------------------------------------------------- files (13, 8)
FILE_REFUSALS = {
    "empty": "CSV file .*empty.csv is empty \\(no header line\\)",
    "header only": "header.csv has a header but no data rows",
    "latin-1": r"latin1.csv is not UTF-8 text \(line 5: b'Amigdalin \\xe9ther.*\); save it as UTF-8",
    "multiclass 0/30": r"classes.csv: multiclass column 'label' must hold class ids 0..K-1 .* it has "
                       r"\[0, 30\] but not \[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, ...\]: renumber the classes 0..1",
    "target column twice": r"twice.csv names more than one column 'measured log solubility in mols per litre' "
                           r"\(columns \[2, 9\] of the header\): rename them so that each name is one column",
    "directory": "CSV file .*folder.csv is a directory",
}


@pytest.mark.parametrize("problem", FILE_REFUSALS)
def test_bad_csv_is_one_line_exit_2(bad_files, tmp_path, capsys, problem):
    import re

    extra = (["--data.init_args.task", "multiclass", "--data.init_args.target_columns", "[label]"]
             if problem.startswith("multiclass") else [])
    status = cli_main(esol_args(tmp_path, bad_files[problem], *extra))
    lines = error_lines(capsys.readouterr().err)
    assert status == 2
    assert len(lines) == 1 and re.search(FILE_REFUSALS[problem], lines[0]), lines


def test_damaged_processed_zinc_file_is_rebuilt(zinc_root, tmp_path, plant_crafted_checkpoint):
    """A ZINC root whose processed train.pt was replaced by a file whose unpickling runs code
    (which PyG's own reader would run): the run says which file and why, rebuilds it from the raw
    files and trains; the planted code never runs. A truncated processed file fails the same
    read (so it takes the same way), naming the file."""
    from graphormer_urpe.utils.torch_files import CheckpointError, read_checkpoint

    data = tmp_path / "data" / "ZINC"
    (data / "subset").mkdir(parents=True)
    (data / "raw").symlink_to(zinc_root / "raw", target_is_directory=True)
    processed = data / "subset" / "processed"
    processed.mkdir()
    for name in ("pre_filter.pt", "pre_transform.pt", "train.pt", "val.pt", "test.pt"):
        (processed / name).write_bytes((zinc_root / "subset" / "processed" / name).read_bytes())
    intact = (processed / "train.pt").read_bytes()
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(intact[:len(intact) // 2])
    with pytest.raises(CheckpointError, match=str(truncated)):
        read_checkpoint(truncated, "cpu", what="processed file")

    marker = plant_crafted_checkpoint(processed / "train.pt")
    done = run_command(["fit", "--config", str(REPO / "configs" / "zinc.yaml"),
                        "--data.init_args.root", str(tmp_path / "data"),
                        "--trainer.default_root_dir", str(tmp_path / "run"),
                        "--trainer.max_steps", "1", "--trainer.limit_val_batches", "1",
                        "--trainer.precision", "32-true", "--trainer.enable_progress_bar", "false",
                        "--model.backbone", TINY, "--model.warmup_steps", "0"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"ZINC processed file {processed / 'train.pt'} is damaged, rebuilding it" in done.stderr
    assert (processed / "train.pt").stat().st_size == len(intact)
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").is_file()
    assert not marker.exists()


# ------------------------------------------------------------------- huge molecule (item 10)
def _limit_memory() -> None:  # pragma: no cover - runs in the child
    """8 GiB of address space: a build that grows without bound fails instead of swapping."""
    resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))


def test_polymer_over_max_nodes_is_skipped_before_featurizing(esol_csv, tmp_path):
    """A 20,000-atom polyethylene SMILES among ESOL's rows: skipped and counted like a rejected
    row; the run finishes within an 8 GiB address space (encoding the polymer's 400 million
    node pairs would not)."""
    table = pd.read_csv(esol_csv)
    polymer = table.iloc[[0]].assign(**{"Compound ID": "polyethylene", "smiles": "C" * 20_000})
    source = tmp_path / "esol_polymer.csv"
    pd.concat([table.iloc[:500], polymer, table.iloc[500:]]).to_csv(source, index=False)
    started = time.perf_counter()
    done = run_command(esol_args(tmp_path, source), preexec_fn=_limit_memory)
    assert done.returncode == 0, done.stderr[-3000:]
    assert time.perf_counter() - started < 300
    assert "skipped 1 of 1129 rows with more than max_nodes=128 atoms (lines 502)" in done.stderr
    # no larger graph reached the store: its encodings are those of ESOL's own molecules
    node_ptr = next((tmp_path / "cache").glob("*/graphs/node_ptr.npy"))
    import numpy as np

    assert np.diff(np.load(node_ptr)).max() <= 128


# ------------------------------------------------------- submit and ablation (item 14)
@pytest.fixture(scope="module")
def ogb_checkpoint(esol_csv, tmp_path_factory) -> Path:
    """A tiny single-target ``ogb``-featurized model (ESOL), as graphormer-urpe-submit needs."""
    work = tmp_path_factory.mktemp("ogb_model")
    assert cli_main(esol_args(work, esol_csv)) == 0
    return work / "run" / "checkpoints" / "last.ckpt"


@pytest.mark.parametrize("target", ["data csv", "data csv symlink", "checkpoint hardlink", "config file"])
def test_prediction_output_that_is_an_input_is_refused(ogb_checkpoint, esol_csv, tmp_path, run_main, target):
    """``graphormer-urpe predict --prediction_writer.output`` naming a file the run reads (the CSV
    it predicts and trained on, the checkpoint, the config file; also through a link): one line,
    exit status 2, before the data is featurized, and every input's bytes unchanged."""
    inputs = {"data": tmp_path / "esol.csv", "checkpoint": tmp_path / "model.ckpt",
              "config": tmp_path / "esol.yaml"}
    shutil.copyfile(esol_csv, inputs["data"])
    shutil.copyfile(ogb_checkpoint, inputs["checkpoint"])
    shutil.copyfile(REPO / "configs" / "esol.yaml", inputs["config"])
    before = {name: hashlib.sha256(path.read_bytes()).hexdigest() for name, path in inputs.items()}
    output = {"data csv": inputs["data"], "data csv symlink": tmp_path / "link.csv",
              "checkpoint hardlink": tmp_path / "hard.ckpt", "config file": inputs["config"]}[target]
    if target == "data csv symlink":
        output.symlink_to(inputs["data"])
    elif target == "checkpoint hardlink":
        os.link(inputs["checkpoint"], output)
    option = {"data csv": "--data.init_args.path", "data csv symlink": "--data.init_args.path",
              "checkpoint hardlink": "--ckpt_path", "config file": "--config"}[target]
    done = run_main(cli_main, ["predict", "--config", str(inputs["config"]), *esol_args(tmp_path, inputs["data"])[3:],
                               "--ckpt_path", str(inputs["checkpoint"]), "--prediction_writer.output", str(output)])
    assert done.returncode == 2, done.stderr[-3000:]
    lines = error_lines(done.stderr)
    assert len(lines) == 1 and lines[0].startswith(
        f"graphormer-urpe: error: --prediction_writer.output {output} is the file of {option} ("), lines
    assert lines[0].endswith("the predictions would overwrite it; choose another output")
    assert {name: hashlib.sha256(path.read_bytes()).hexdigest() for name, path in inputs.items()} == before
    assert not (tmp_path / "cache").exists()  # refused before the CSV was featurized


def test_submit_checks_the_split_dict_before_featurizing(ogb_checkpoint, pcqm_source, tmp_path,
                                                         capsys):
    """A PCQM4M root of real molecules whose test split is not OGB's size: refused before the
    table is featurized (minutes for the real data set)."""
    folder = write_root(tmp_path / "root", pcqm_source, PCQM4M)
    status = submit.main(["--dataset", "pcqm4m", "--ckpt", str(ogb_checkpoint), "--root",
                          str(tmp_path / "root"), "--out-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2
    assert err[-1].startswith("graphormer-urpe-submit: error: split 'test' has 200 rows; the official")
    assert not (folder / "processed_graphormer_urpe").exists()
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("content", ["[{\"attention\": \"urpe\", \"seed\": 0", "{\"runs\": []}",
                                     "[{\"recipe\": \"x\"}]"])
def test_damaged_ablation_results_are_refused_at_start_and_kept(tmp_path, capsys, content):
    results = tmp_path / "results.json"
    results.write_text(content)
    with pytest.raises(SystemExit) as stopped:
        ablation.main(["--config", str(REPO / "configs" / "zinc.yaml"), "--results", str(results),
                       "--runs-dir", str(tmp_path / "runs"), "--name", "damaged"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"graphormer-urpe-ablation: error: {results}: ")
    assert not (tmp_path / "runs").exists()  # no run started
    assert results.read_text() == content  # never rewritten


#: The file each way of naming a checkpoint opens, in the run directory ``run``.
CRAFTED_AT = {"FILE": "checkpoints/last.ckpt", "last": "checkpoints/last.ckpt", "best": "checkpoints/last.ckpt",
              "hpc": "hpc_ckpt_1.ckpt", "none under SLURM": "hpc_ckpt_1.ckpt"}
#: What makes Lightning open its HPC checkpoint without --ckpt_path: a job that srun started.
SLURM_JOB = {"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "train", "SLURM_NODEID": "0", "SLURM_PROCID": "0",
             "SLURM_LOCALID": "0", "SLURM_NNODES": "1", "SLURM_JOB_ID": "1", "SLURM_NODELIST": "localhost"}


@pytest.mark.parametrize("command", ["test --ckpt_path FILE", "fit --ckpt_path last", "fit --ckpt_path hpc",
                                     "in-process test --ckpt_path hpc", "in-process validate --ckpt_path best",
                                     "in-process test --ckpt_path none under SLURM"])
def test_crafted_checkpoint_is_refused_in_one_line_without_running_its_code(
        esol_csv, tmp_path, plant_crafted_checkpoint, run_main, monkeypatch, command):
    """A checkpoint is data: one whose unpickling would run code is refused by name, in one
    line, before any data is read, and its code never runs, however it is named (a file,
    ``last``, ``best`` (the run's last.ckpt, which records it), Lightning's ``hpc``, or none at all
    in a SLURM job, where Lightning opens its HPC checkpoint itself), also with
    ``--weights_only false``. Through the installed command, or its ``main()`` (``in-process``)."""
    in_process = command.startswith("in-process ")
    subcommand, _, which = command.removeprefix("in-process ").split(maxsplit=2)
    crafted = tmp_path / "run" / CRAFTED_AT[which]
    marker = plant_crafted_checkpoint(crafted)
    ckpt_path = {"FILE": ["--ckpt_path", str(crafted)], "none under SLURM": []}.get(which, ["--ckpt_path", which])
    weights_only = [] if which in ("FILE", "last") else ["--weights_only", "false"]
    args = [subcommand, *esol_args(tmp_path, esol_csv)[1:], *ckpt_path, *weights_only]
    if which == "none under SLURM":
        for name, value in SLURM_JOB.items():
            monkeypatch.setenv(name, value)
    done = run_main(cli_main, args) if in_process else run_command(args)
    assert done.returncode == 2, done.stderr[-3000:]
    assert error_lines(done.stderr) == [
        f"graphormer-urpe: error: checkpoint {crafted} cannot be read: it holds objects other than "
        "tensors and plain values, which are never loaded"]
    assert not marker.exists() and not (tmp_path / "cache").exists()


@pytest.fixture(scope="module")
def run_with_a_best(esol_csv, tmp_path_factory) -> Path:
    """A tiny ESOL run whose epoch of 2 batches ended with a validation: its checkpoints folder
    holds the best val/mae checkpoint beside last.ckpt, which records it."""
    work = tmp_path_factory.mktemp("run_with_a_best")
    assert cli_main(esol_args(work, esol_csv, "--trainer.limit_train_batches", "2")) == 0
    return work


@pytest.mark.parametrize("subcommand", ["test", "predict"])
def test_ckpt_path_best_is_the_best_checkpoint_its_run_records(run_with_a_best, esol_csv, tmp_path, subcommand):
    """``--ckpt_path best`` in a new process (Lightning's own ``best`` is a traceback there): the
    best checkpoint that the checkpoint folder's last.ckpt records, read as data first."""
    from graphormer_urpe.training.lightning_cli import build_cli

    folder = run_with_a_best / "run" / "checkpoints"
    [best] = [path for path in folder.iterdir() if path.name.startswith("epoch=0-step=2-val_mae=")]
    cli = build_cli([subcommand, *esol_args(run_with_a_best, esol_csv)[1:], "--trainer.default_root_dir",
                     str(tmp_path / "run"), "--checkpoint.dirpath", str(folder), "--ckpt_path", "best"])
    assert cli.trainer.ckpt_path == str(best)
    if subcommand == "predict":
        assert len(pd.read_csv(tmp_path / "run" / "predictions.csv")) > 0
    else:
        assert cli.trainer.callback_metrics["test/mae"].item() > 0


@pytest.mark.parametrize("run", ["no checkpoint", "no validation", "best file gone"])
def test_ckpt_path_best_without_a_best_checkpoint_is_one_line(run_with_a_best, ogb_checkpoint, esol_csv,
                                                              tmp_path, run_main, run):
    folder = {"no checkpoint": tmp_path / "empty", "no validation": ogb_checkpoint.parent,
              "best file gone": tmp_path / "copied"}[run]
    if run == "best file gone":  # a copy of the run's last.ckpt without the best file it records
        folder.mkdir()
        shutil.copyfile(run_with_a_best / "run" / "checkpoints" / "last.ckpt", folder / "last.ckpt")
    done = run_main(cli_main, ["test", *esol_args(tmp_path, esol_csv)[1:], "--checkpoint.dirpath", folder,
                               "--ckpt_path", "best"])
    assert done.returncode == 2, done.stderr[-3000:]
    [line] = error_lines(done.stderr)
    assert line.startswith("graphormer-urpe: error: --ckpt_path best: "), line
    assert {"no checkpoint": f"{folder} holds no last.ckpt, which records the run's best checkpoint",
            "no validation": f"{folder / 'last.ckpt'} records no best val/mae checkpoint (no validation has run)",
            "best file gone": f"that {folder / 'last.ckpt'} records is not in {folder}"}[run] in line
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("name", ["hpc", "registry", "registry:graphormer"])
def test_a_lightning_checkpoint_name_that_names_no_file_is_one_line(esol_csv, tmp_path, run_main, name):
    done = run_main(cli_main, ["test", *esol_args(tmp_path, esol_csv)[1:], "--ckpt_path", name])
    assert done.returncode == 2, done.stderr[-3000:]
    assert error_lines(done.stderr) == [f"graphormer-urpe: error: --ckpt_path {name}: " + (
        f"{tmp_path / 'run'} holds no checkpoint of that name (hpc_ckpt_N.ckpt, which Lightning writes when "
        "SLURM requeues a run); give a checkpoint file" if name == "hpc" else
        "Lightning's model registry needs the litmodels package, which is not installed; give a checkpoint file")]
    assert not (tmp_path / "cache").exists()


def test_second_fit_into_a_run_directory_in_use_is_refused(esol_csv, tmp_path, start_lock_holder):
    """Two fits into one run directory at once: the second stops before reading any data, naming
    the first one's pid (each would overwrite the other's checkpoints); the first goes on."""
    first = start_lock_holder([str(COMMAND), *esol_args(tmp_path, esol_csv)[:-2], "--trainer.max_steps",
                               "100000", "--data.init_args.cache_root", str(tmp_path / "first_cache")],
                              tmp_path / "run" / "fit.lock", stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    second = run_command([*esol_args(tmp_path, esol_csv), "--checkpoint.overwrite", "true"])
    assert first.poll() is None, "the first fit must still be running"
    assert second.returncode == 2, second.stderr[-3000:]
    assert error_lines(second.stderr) == [
        f"graphormer-urpe: error: {tmp_path / 'run'} is in use by another training run (pid "
        f"{first.pid}); wait for it to end, or choose another --trainer.default_root_dir"]
    assert not (tmp_path / "cache").exists()  # refused before the CSV was featurized


@pytest.mark.parametrize("data", ["classification task", "other target column", "zinc featurizer"])
def test_checkpoint_of_other_data_is_refused_by_name(ogb_checkpoint, esol_csv, tmp_path, run_main, data):
    """``test --ckpt_path`` with a checkpoint trained on another task or another target column
    would report a metric of a model answering another question, and one of another featurizer
    fails on its weights: refused in one line naming the difference, before the data is
    featurized."""
    if data == "classification task":
        table = pd.read_csv(esol_csv)
        table["soluble"] = (table[ESOL_TARGET] > -3).astype(int)
        csv, extra = tmp_path / "soluble.csv", ["--data.init_args.task", "classification",
                                                 "--data.init_args.target_columns", "[soluble]"]
        table.to_csv(csv, index=False)
        difference = (f"task 'regression', the data's 'classification'; target columns "
                      f"['{ESOL_TARGET}'], the data's ['soluble']")
    elif data == "other target column":
        csv, extra = esol_csv, ["--data.init_args.target_columns", "[Molecular Weight]"]
        difference = f"target columns ['{ESOL_TARGET}'], the data's ['Molecular Weight']"
    else:  # its embedding tables would not fit: a state_dict error after the data build
        csv, extra = esol_csv, ["--data.init_args.featurizer", "zinc"]
        difference = "featurizer 'ogb', the data's 'zinc'"
    done = run_main(cli_main, ["test", *esol_args(tmp_path, csv, *extra)[1:], "--ckpt_path", str(ogb_checkpoint)])
    assert done.returncode == 2, done.stderr[-3000:]
    assert error_lines(done.stderr) == [
        f"graphormer-urpe: error: --ckpt_path {ogb_checkpoint} was trained on other data (checkpoint's "
        f"{difference}): use a checkpoint of this data, or configure the data it was trained on"]
    assert not (tmp_path / "cache").exists()  # refused before the CSV was featurized


def test_run_directory_that_cannot_be_written_is_refused_before_the_data(esol_csv, tmp_path, run_main):
    """A run directory that cannot hold the logs and checkpoints (here under a regular file; a
    read-only file system fails the same way) is one line before the data is featurized, not an
    OSError from the logger after the build."""
    (tmp_path / "file").write_text("")
    run_dir = tmp_path / "file" / "run"
    done = run_main(cli_main, [*esol_args(tmp_path, esol_csv), "--trainer.default_root_dir", str(run_dir)])
    assert done.returncode == 2, done.stderr[-3000:]
    assert error_lines(done.stderr) == [
        f"graphormer-urpe: error: --trainer.default_root_dir {run_dir} cannot be written (Not a directory)"]
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("kind", ["missing", "directory"])
def test_ckpt_path_that_is_no_checkpoint_file_is_one_line_before_the_data(esol_csv, tmp_path, run_main, kind):
    ckpt = tmp_path / "model.ckpt"
    if kind == "directory":
        ckpt.mkdir()
    done = run_main(cli_main, ["test", *esol_args(tmp_path, esol_csv)[1:], "--ckpt_path", str(ckpt)])
    assert done.returncode == 2, done.stderr[-3000:]
    what = "does not exist" if kind == "missing" else "is a directory"
    assert error_lines(done.stderr) == [f"graphormer-urpe: error: checkpoint {ckpt} {what}"]
    assert not (tmp_path / "cache").exists()


#: ``configs/csv.yaml`` (the fine-tuning recipe) on a small CSV: each refusal, in one line.
SMALL_CSV_REFUSALS = {
    "one class": (lambda rows: [(s, 1) for s, _ in rows[:30]],
                  ["--data.init_args.task", "classification", "--model.loss", "null"],
                  "classification column 'y' has only class 1: a classifier needs both 0 and 1"),
    "one row": (lambda rows: rows[:1], [],
                "the 'val' and 'test' split(s) would have no rows (1 usable of 1 rows, split 'random'"),
    "every molecule over max_nodes": (lambda rows: rows[:20], ["--data.init_args.max_nodes", "3"],
                                      "no row is usable: of its 20 rows, 20 with more than max_nodes=3 atoms"),
    "val_check_interval over an epoch": (lambda rows: rows[:60], ["--trainer.val_check_interval", "10"],
                                         "--trainer.val_check_interval 10 is more than the 2 training "
                                         "batches of an epoch (48 training graphs, batch_size 32)"),
}


@pytest.mark.parametrize("problem", SMALL_CSV_REFUSALS)
def test_small_csv_is_refused_in_one_line_before_training(esol_csv, tmp_path, problem):
    """Through the installed command: a classification CSV with one class (it trained and saved
    val_auroc 0), a CSV too small for its splits or whose every molecule is over max_nodes (a
    numpy traceback), a validation interval longer than the epoch (Lightning's traceback): one
    line each, exit status 2, no checkpoint written."""
    select, extra, message = SMALL_CSV_REFUSALS[problem]
    esol = pd.read_csv(esol_csv)
    rows = list(zip(esol["smiles"], esol["measured log solubility in mols per litre"]))
    path = tmp_path / "small.csv"
    pd.DataFrame(select(rows), columns=["smiles", "y"]).to_csv(path, index=False)
    done = run_command(["fit", "--config", str(REPO / "configs" / "csv.yaml"), "--trainer.default_root_dir",
                        str(tmp_path / "run"), "--trainer.max_steps", "20", "--trainer.enable_progress_bar", "false",
                        "--data.init_args.path", str(path), "--data.init_args.target_columns", "[y]",
                        "--data.init_args.cache_root", str(tmp_path / "cache"), *extra])
    assert done.returncode == 2, done.stderr[-3000:]
    lines = error_lines(done.stderr)
    assert len(lines) == 1 and lines[0].startswith("graphormer-urpe: error: ") and message in lines[0], lines
    assert problem.startswith("val_check_interval") or str(path) in lines[0]  # the file is named
    assert not list((tmp_path / "run").glob("checkpoints/*.ckpt"))

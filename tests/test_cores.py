"""Usable cores: the default of every parallel build step (encoding threads, featurizing
processes, prediction workers)."""
from __future__ import annotations

import os

import pytest

from graphormer_urpe.utils import process as cores
from graphormer_urpe.utils.process import usable_cores


def test_usable_cores_follow_the_affinity_mask(monkeypatch):
    if hasattr(os, "sched_getaffinity"):
        assert usable_cores() == len(os.sched_getaffinity(0))
        monkeypatch.setattr(cores.os, "sched_getaffinity", lambda pid: {3})
        assert usable_cores() == 1
    monkeypatch.delattr(cores.os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(cores.os, "cpu_count", lambda: None)
    assert usable_cores() == 1
    monkeypatch.setattr(cores.os, "cpu_count", lambda: 6)
    assert usable_cores() == 6


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity on this platform")
def test_encode_threads_default_to_usable_cores_and_the_cli_flag_overrides(monkeypatch, tmp_path):
    from graphormer_urpe.data import CSVDataModule, ZINCDataModule
    from graphormer_urpe.training.lightning_cli import build_cli

    monkeypatch.setattr(cores.os, "sched_getaffinity", lambda pid: {0, 1, 2})
    assert ZINCDataModule(root="unused").encode_threads == 3
    assert ZINCDataModule(root="unused", encode_threads=1).encode_threads == 1
    table = tmp_path / "t.csv"
    table.write_text("smiles,y\nCCO,1.0\nCCN,2.0\n")
    args = ["--data=CSVDataModule", f"--data.path={table}", "--trainer.logger=false"]
    assert build_cli(args, run=False).datamodule.encode_threads == 3
    cli = build_cli([*args, "--data.encode_threads=1", "--data.build_workers=2"], run=False)
    assert (cli.datamodule.encode_threads, cli.datamodule.build_workers) == (1, 2)
    assert isinstance(cli.datamodule, CSVDataModule)


# ------------------------------------------------ worker processes: as many as are useful
def test_predict_starts_no_more_workers_than_chunks_or_cores(tmp_path):
    """``graphormer-urpe-predict --workers 40`` (the installed command) forks one worker for a
    3-row input (one chunk), and for three 1-row chunks no more than the usable cores, saying
    so in one line; every row is predicted. It forked 40."""
    from helpers.forks import run_counting_forks
    from test_predict import PREDICT

    source, output = tmp_path / "in.smi", tmp_path / "out.csv"
    source.write_text("CCO\nCCN\nc1ccccc1\n")
    command = [PREDICT, "--ckpt", "pretrained:zinc-descriptors", "--input", source, "--output", output,
               "--workers", "40", "--quiet"]
    for chunk_rows, useful in (("1024", 1), ("1", min(3, usable_cores()))):
        done, forks = run_counting_forks([*command, "--chunk-rows", chunk_rows], tmp_path,
                                         env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stderr[-3000:]
        assert forks == useful, (chunk_rows, forks)
        assert (f"--workers 40 is more than the {usable_cores()} cores this process may use: at most "
                f"{usable_cores()} worker processes") in done.stderr.splitlines()
        assert output.read_text().count("\n") == 4 and ",\n" in output.read_text()  # 3 rows, no error


def test_fit_starts_no_more_data_build_workers_or_threads_than_the_cores(esol_csv, tmp_path):
    """``--data.init_args.build_workers 100000`` and ``encode_threads 100000`` (the installed
    ``graphormer-urpe fit``, 48 ESOL molecules): the data build forks no more workers than the
    usable cores, each option says so in one warning, and the fit trains. 100,000 forked
    2,847 processes before the out-of-memory killer came."""
    import pandas as pd
    from helpers.forks import run_counting_forks
    from test_refused_input import COMMAND, REPO, esol_args

    table = tmp_path / "esol48.csv"
    pd.read_csv(esol_csv).iloc[:48].to_csv(table, index=False)
    done, forks = run_counting_forks(
        [COMMAND, *esol_args(tmp_path, table, "--data.init_args.build_workers", "100000",
                             "--data.init_args.encode_threads", "100000")],
        tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert 0 < forks <= usable_cores()
    for option in ("build_workers", "encode_threads"):
        assert (f"{option} 100000 is more than the {usable_cores()} cores this process may use: "
                f"using {usable_cores()}") in done.stderr, done.stderr[-3000:]
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").is_file()


@pytest.mark.parametrize("option", ["build_workers=0", "build_workers=-1", "encode_threads=0",
                                    "encode_threads=-1"])
def test_no_worker_or_thread_at_all_is_refused_in_one_line_before_the_data(esol_csv, tmp_path, capsys, option):
    """``--data.init_args.encode_threads 0`` (or -1, and ``build_workers``) was a ValueError
    traceback from the encoder once the data was featurized; now one line, exit status 2,
    before the CSV is read."""
    from test_refused_input import cli_main, error_lines, esol_args

    name, value = option.split("=")
    status = cli_main(esol_args(tmp_path, esol_csv, f"--data.init_args.{option}"))
    assert status == 2
    assert error_lines(capsys.readouterr().err) == [
        f"graphormer-urpe: error: {name} must be >= 1, or null for every usable core, got {value}"]
    assert not (tmp_path / "cache").exists()


def test_no_encoding_thread_is_refused_by_the_installed_command(esol_csv, tmp_path):
    """The same refusal through the console script: one line, exit status 2, no traceback."""
    from test_refused_input import error_lines, esol_args, run_command

    done = run_command(esol_args(tmp_path, esol_csv, "--data.init_args.encode_threads", "0"))
    assert done.returncode == 2, done.stderr[-3000:]
    assert error_lines(done.stderr) == [
        "graphormer-urpe: error: encode_threads must be >= 1, or null for every usable core, got 0"]
    assert not (tmp_path / "cache").exists()

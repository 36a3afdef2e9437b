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

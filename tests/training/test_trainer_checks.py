"""The trainer a command builds is checked, not only the options' spelling: a precision plugin
or a strategy class the training step does not serve, ``16-mixed`` that Lightning would run as
``bf16-mixed`` on a CPU, and a node count no launcher provides are refused in one line, exit
status 2, before the data is read (ZINC's root stays empty)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from graphormer_urpe.cli.fit import main

REPO = Path(__file__).resolve().parents[2]
SPAWNED_DDP = json.dumps({"class_path": "lightning.pytorch.strategies.DDPStrategy",
                          "init_args": {"start_method": "spawn"}})
HALF_PRECISION = ["--trainer.plugins", "lightning.pytorch.plugins.precision.HalfPrecision",
                  "--trainer.plugins.precision", "16-true", "--trainer.precision", "null"]
NUM_NODES = ("trainer.num_nodes 2 needs the other nodes' processes, which nothing starts here: run it under a "
             "cluster's launcher (SLURM, torchrun, ...) or with MASTER_ADDR and NODE_RANK set on each node; on "
             "one machine give --trainer.num_nodes 1 and --trainer.devices N")

REFUSED = {
    "HalfPrecision plugin": ("fit", HALF_PRECISION, "the training step needs trainer.precision 32-true, bf16-mixed "
                             "or 16-mixed (got HalfPrecision 16-true: the step keeps float32 weights and optimizer "
                             "moments)"),
    "spawned DDPStrategy": ("fit", ["--trainer.strategy", SPAWNED_DDP], "the training step needs trainer.strategy "
                            "ddp or auto (got DDPStrategy with start_method 'spawn': the step averages the gradients "
                            "of DDP's processes itself; sharded or spawned strategies it does not serve)"),
    "ddp_spawn in test": ("test", ["--trainer.strategy", "ddp_spawn"], "test needs trainer.strategy ddp or auto "
                          "(got DDPStrategy with start_method 'spawn': the command's configuration does not pickle "
                          "into spawned processes)"),
    "16-mixed on a CPU": ("fit", ["--trainer.precision", "16-mixed"], "trainer.precision 16-mixed needs a CUDA "
                          "GPU: here Lightning would run bf16-mixed instead; give --trainer.precision bf16-mixed "
                          "(or 32-true)"),
    "num_nodes 2, no launcher": ("fit", ["--trainer.num_nodes", "2"], NUM_NODES),
    "num_nodes 2 in validate": ("validate", ["--trainer.num_nodes", "2"], NUM_NODES),
}


def zinc_args(tmp_path: Path, subcommand: str, *extra: str) -> list[str]:
    return [subcommand, "--config", str(REPO / "configs" / "zinc.yaml"), "--trainer.default_root_dir",
            str(tmp_path / "run"), "--data.init_args.root", str(tmp_path / "empty"), "--trainer.accelerator", "cpu",
            *extra]


@pytest.mark.parametrize("case", REFUSED)
def test_the_built_trainer_is_refused_in_one_line_before_the_data(tmp_path, run_main, monkeypatch, case):
    for name in ("MASTER_ADDR", "NODE_RANK", "GROUP_RANK"):
        monkeypatch.delenv(name, raising=False)
    if case == "16-mixed on a CPU" and torch.cuda.is_available():
        pytest.skip("Lightning runs bf16-mixed for 16-mixed only on a CPU")
    subcommand, extra, message = REFUSED[case]
    done = run_main(main, zinc_args(tmp_path, subcommand, *extra))
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == f"graphormer-urpe: error: {message}", done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "empty").exists()


@pytest.mark.parametrize("settings", [
    {"plugins": "MixedPrecision 16-mixed cpu"},  # fp16 autocast on a CPU, given on purpose
    {"precision": "bf16-mixed"}, {"precision": "64-true"}, {"precision": "32-true"},
    {"strategy": "ddp", "devices": 1},  # DDP's processes started as scripts
    {"num_nodes": 2, "MASTER_ADDR": "10.0.0.1"},  # started by hand on each node
])
def test_what_the_step_serves_passes_the_check(monkeypatch, settings):
    import lightning.pytorch as pl
    from jsonargparse import Namespace
    from lightning.pytorch.plugins.precision import MixedPrecision

    from graphormer_urpe.training.fit_checks import check_trainer

    settings = dict(settings)
    if "MASTER_ADDR" in settings:
        monkeypatch.setenv("MASTER_ADDR", settings.pop("MASTER_ADDR"))
    if "plugins" in settings:
        settings["plugins"] = [MixedPrecision("16-mixed", "cpu")]
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, **settings)
    check_trainer(trainer, Namespace(precision=settings.get("precision")), "fit")


def test_spawned_ddp_strategy_through_the_installed_command(tmp_path):
    """The class-path spelling failed with "Can't pickle local object" after the trainer was built."""
    command = Path(sys.executable).with_name("graphormer-urpe")
    done = subprocess.run([str(command), *zinc_args(tmp_path, "fit", "--trainer.strategy", SPAWNED_DDP)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == f"graphormer-urpe: error: {REFUSED['spawned DDPStrategy'][2]}"
    assert "Traceback" not in done.stderr and not (tmp_path / "empty").exists()


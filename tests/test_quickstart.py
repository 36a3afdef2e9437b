"""The Quick start (`make quickstart` -> scripts/quickstart.py) on the real ZINC-12k."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import torch
import yaml

from graphormer_urpe.training.lightning_cli import build_cli

REPO = Path(__file__).resolve().parents[1]
CONFIGS = ["--config", str(REPO / "configs" / "zinc.yaml"),
           "--config", str(REPO / "configs" / "quickstart.yaml")]
OVERLAY = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())


def load_quickstart():
    spec = importlib.util.spec_from_file_location("quickstart", REPO / "scripts" / "quickstart.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quickstart_budget_is_steps_capped_by_time_and_the_schedule_ends_at_it():
    cli = build_cli(CONFIGS, run=False)
    trainer, hparams = cli.trainer, cli.model.hparams
    assert trainer.max_steps == OVERLAY["trainer"]["max_steps"]
    assert OVERLAY["trainer"]["max_time"] == "00:00:07:00"
    # The lr decays to its end exactly at the step budget (total_steps unset follows max_steps),
    # so the result depends on the steps, not on the machine's load.
    assert hparams.total_steps in (None, trainer.max_steps)
    assert 0 < hparams.warmup_steps < trainer.max_steps / 10
    backbone = hparams.backbone  # the paper's model family: Graphormer with URPE attention
    assert backbone["attention"] == "urpe" and not backbone["share_urpe_scale"]
    assert backbone == {**backbone, **OVERLAY["model"]["backbone"]}
    # Batches of similar-sized molecules: the budget's steps are ~1.6x faster on a CPU.
    assert cli.datamodule.bucket_batches == OVERLAY["data"]["init_args"]["bucket_batches"] > 0


def test_quickstart_main_trains_and_reports_its_model_and_test_mae(
        zinc_data_root, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # main() moves to the repository; this restores the cwd after
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    run_dir = tmp_path / "run"
    threads = torch.get_num_threads()
    try:
        load_quickstart().main([
            "--trainer.default_root_dir", str(run_dir),
            "--data.init_args.root", str(zinc_data_root),
            "--trainer.max_steps", "3", "--model.warmup_steps", "1",
            "--trainer.limit_train_batches", "3",
            "--trainer.limit_val_batches", "2", "--trainer.limit_test_batches", "2",
            "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"])
        # Two threads on a shared 2-core CPU ran 7-12x slower (docs/quickstart.md).
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    backbone = OVERLAY["model"]["backbone"]
    assert (f"=== Graphormer + URPE, {backbone['num_layers']} layers x {backbone['hidden_dim']} "
            "dim, 8 heads on ZINC-12k") in out
    assert re.search(r"optimizer steps\s+3\n", out)
    val = float(re.search(r"validation MAE\s+([0-9.]+)", out).group(1))
    test = float(re.search(r"test MAE\s+([0-9.]+)", out).group(1))
    assert 0 < val < 10 and 0 < test < 10  # ZINC's penalized logP: an untrained model's MAE ~1.5
    best = Path(re.search(r"best checkpoint\s+(\S+)", out).group(1))
    assert best.parent == run_dir / "checkpoints" and best.name.startswith("epoch=0-step=3-")
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()


def test_a_second_quickstart_trains_into_a_new_run_directory(tmp_path, monkeypatch):
    """`make quickstart` run twice keeps the first run's model: the second goes to `<dir>-2`."""
    monkeypatch.chdir(tmp_path)  # run_dir_arguments reads the run directories relative to the cwd
    quickstart = load_quickstart()
    default = OVERLAY["trainer"]["default_root_dir"]
    assert quickstart.run_dir_arguments([]) == []
    (tmp_path / default / "checkpoints").mkdir(parents=True)
    assert quickstart.run_dir_arguments([]) == []  # an empty folder holds no model
    (tmp_path / default / "checkpoints" / "last.ckpt").write_bytes(b"model")
    assert quickstart.run_dir_arguments([]) == ["--trainer.default_root_dir", f"{default}-2"]
    (tmp_path / f"{default}-2" / "checkpoints").mkdir(parents=True)
    (tmp_path / f"{default}-2" / "checkpoints" / "last.ckpt").write_bytes(b"model")
    assert quickstart.run_dir_arguments([]) == ["--trainer.default_root_dir", f"{default}-3"]
    assert quickstart.run_dir_arguments(["--trainer.default_root_dir", "mine"]) == []

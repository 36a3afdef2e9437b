"""The training CLI end to end on the real ZINC-12k: fit, resume from last.ckpt, test, DDP."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from graphormer_urpe.data.facts import DataFacts
from graphormer_urpe.training.lightning_cli import build_cli
from graphormer_urpe.prediction.load import load_module

REPO = Path(__file__).resolve().parents[2]
#: A small backbone without dropout, so two runs with the same data order give the same weights.
TINY_BACKBONE = {"attention": "urpe", "num_layers": 2, "hidden_dim": 16, "ffn_dim": 16,
                 "num_heads": 2, "dropout": 0.0, "attention_dropout": 0.0,
                 "activation_dropout": 0.0}


def zinc_args(run_dir: Path, data_root: Path, *extra: str) -> list[str]:
    return [
        "--config", str(REPO / "configs" / "zinc.yaml"),
        "--trainer.default_root_dir", str(run_dir),
        "--trainer.check_val_every_n_epoch", "1",  # the recipe validates every 10 epochs
        "--data.init_args.max_hops", "5",
        "--trainer.precision", "32-true",
        "--trainer.limit_train_batches", "3",
        "--trainer.limit_val_batches", "2",
        "--trainer.limit_test_batches", "2",
        "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false",
        "--trainer.log_every_n_steps", "1",
        "--model.backbone", json.dumps(TINY_BACKBONE),
        "--model.warmup_steps", "4",
        "--model.total_steps", "20",
        "--data.init_args.root", str(data_root),
        "--data.init_args.batch_size", "16",
        *extra,
    ]


def last_checkpoint(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)


def test_fit_writes_logs_and_checkpoints_and_links_data_facts(zinc_data_root, tmp_path):
    run_dir = tmp_path / "run"
    cli = build_cli(["fit", *zinc_args(run_dir, zinc_data_root, "--trainer.max_steps", "3")])
    assert cli.trainer.global_step == 3
    hparams = cli.model.hparams
    assert cli.model.facts == DataFacts(num_atom_embeddings=29, num_bond_embeddings=5, num_targets=1,
                                        max_hops=5, featurizer="zinc", node_encodings={})
    assert hparams.facts == cli.model.facts.as_dict()  # plain values in the checkpoint
    checkpoints = {p.name for p in (run_dir / "checkpoints").iterdir()}
    assert "last.ckpt" in checkpoints
    assert any(n.startswith("epoch=0-step=3-val_mae=") for n in checkpoints), checkpoints
    metrics = next((run_dir / "csv").rglob("metrics.csv")).read_text()
    assert "val/mae" in metrics and "train/loss" in metrics
    assert any((run_dir / "tensorboard").rglob("events.out.tfevents.*"))


def test_killed_run_resumes_with_same_steps_schedule_and_data_order(zinc_data_root, tmp_path):
    """6 steps, then resume from last.ckpt to 9, equals 9 uninterrupted steps."""
    interrupted, straight = tmp_path / "interrupted", tmp_path / "straight"
    build_cli(["fit", *zinc_args(interrupted, zinc_data_root, "--trainer.max_steps", "6")])
    build_cli(["fit", *zinc_args(interrupted, zinc_data_root, "--trainer.max_steps", "9",
                                 "--ckpt_path", "last")])
    build_cli(["fit", *zinc_args(straight, zinc_data_root, "--trainer.max_steps", "9")])
    resumed, reference = last_checkpoint(interrupted), last_checkpoint(straight)
    assert resumed["global_step"] == reference["global_step"] == 9
    assert resumed["lr_schedulers"][0]["last_epoch"] == reference["lr_schedulers"][0]["last_epoch"] == 9
    for name, value in reference["state_dict"].items():
        torch.testing.assert_close(resumed["state_dict"][name], value, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("resident", [False, True])
def test_resume_from_a_validation_checkpoint_inside_an_epoch_is_exact(zinc_data_root, tmp_path,
                                                                      resident):
    """Epochs of 5 batches, validation (and a checkpoint) every 2: resuming from the one saved
    after step 7 (epoch 1, 2 of its 5 batches done) trains on exactly the remaining batches, so
    step 12 equals the uninterrupted run's bit for bit (DataLoader and device-resident data)."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    mid_epoch = ["--trainer.max_steps", "12", "--trainer.limit_train_batches", "5",
                 "--trainer.val_check_interval", "2", "--checkpoint.save_top_k", "-1",
                 "--data.init_args.device_resident", str(resident).lower()]
    build_cli(["fit", *zinc_args(straight, zinc_data_root, *mid_epoch)])
    [checkpoint] = (straight / "checkpoints").glob("epoch=1-step=7-*.ckpt")
    build_cli(["fit", *zinc_args(resumed, zinc_data_root, *mid_epoch, "--ckpt_path",
                                 str(checkpoint))])
    reference, result = last_checkpoint(straight), last_checkpoint(resumed)
    assert result["global_step"] == reference["global_step"] == 12
    for name, value in reference["state_dict"].items():
        assert torch.equal(result["state_dict"][name], value), name


def test_test_subcommand_reports_mae_from_a_checkpoint(zinc_data_root, tmp_path):
    run_dir = tmp_path / "run"
    build_cli(["fit", *zinc_args(run_dir, zinc_data_root, "--trainer.max_steps", "2")])
    cli = build_cli(["test", *zinc_args(run_dir, zinc_data_root),
                     "--ckpt_path", str(run_dir / "checkpoints" / "last.ckpt")])
    mae = cli.trainer.callback_metrics["test/mae"].item()
    assert 0.0 < mae < 10.0
    # A checkpoint written before the facts were one hyperparameter (each fact its own) tests the same.
    old = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    old["hyper_parameters"].update(old["hyper_parameters"].pop("facts"))
    torch.save(old, tmp_path / "old.ckpt")
    cli = build_cli(["test", *zinc_args(run_dir, zinc_data_root), "--ckpt_path", str(tmp_path / "old.ckpt")])
    assert cli.trainer.callback_metrics["test/mae"].item() == mae


def test_weight_decay_pulls_urpe_scale_toward_one_not_zero(zinc_data_root, tmp_path):
    """Slots the data never reaches (distance 38: longer than any ZINC molecule's paths) get no
    gradient, so only weight decay moves them; it must leave C at its neutral 1."""
    run_dir = tmp_path / "run"
    build_cli(["fit", *zinc_args(run_dir, zinc_data_root, "--trainer.max_steps", "3",
                                 "--model.weight_decay", "0.5", "--model.lr", "0.01")])
    checkpoint = last_checkpoint(run_dir)
    tables = load_module(run_dir / "checkpoints" / "last.ckpt").model.urpe_scale_tables()  # [layers, slots, heads]
    assert torch.equal(tables[:, 38], torch.ones_like(tables[:, 38]))
    assert not torch.equal(tables[:, 1], torch.ones_like(tables[:, 1])), "used slots train"
    # Every kind of parameter decays, as in Graphormer's recipe, each in its own named group.
    groups = checkpoint["optimizer_states"][0]["param_groups"]
    assert {g["name"]: g["weight_decay"] for g in groups} == {
        "weight": 0.5, "embedding": 0.5, "bias": 0.5, "layernorm": 0.5, "urpe_scale": 0.5}


def test_schedule_follows_trainer_max_steps(zinc_data_root, tmp_path, caplog):
    args = [a for a in zinc_args(tmp_path / "run", zinc_data_root) if a != "--model.total_steps"]
    args.remove("20")
    cli = build_cli(["fit", *args, "--trainer.max_steps", "8", "--trainer.limit_train_batches",
                     "10"])
    scheduler = cli.trainer.lr_scheduler_configs[0].scheduler
    assert cli.trainer.global_step == 8
    lrs = [scheduler.lr_lambdas[0](step) for step in (3, 7)]  # updates 4 and 8
    assert lrs[0] == 1.0 and lrs[1] == pytest.approx(1e-9 / 2e-4)  # peak at warmup, end at 8
    with caplog.at_level(logging.WARNING):
        build_cli(["fit", *args, "--trainer.max_steps", "3", "--model.total_steps", "20",
                   "--trainer.default_root_dir", str(tmp_path / "other")])
    assert "decays over model.total_steps=20 but the trainer stops after 3 steps" in caplog.text


def test_warmup_longer_than_the_trainer_budget_is_a_clear_error(zinc_data_root, tmp_path):
    args = [a for a in zinc_args(tmp_path / "run", zinc_data_root) if a != "--model.total_steps"]
    args.remove("20")
    with pytest.raises(ValueError, match=r"warmup_steps \(60\) must be below the schedule's "
                                         r"total_steps \(5, from trainer.max_steps\)"):
        build_cli(["fit", *args, "--trainer.max_steps", "5", "--model.warmup_steps", "60"])


def test_a_fit_without_a_logger_trains(zinc_data_root, tmp_path, run_main):
    """``--trainer.logger false``: the learning-rate monitor has nothing to log to and is left out,
    instead of stopping the run once the data is built."""
    from graphormer_urpe.cli.fit import main

    done = run_main(main, ["fit", *zinc_args(tmp_path / "run", zinc_data_root, "--trainer.max_steps", "2",
                                             "--trainer.logger", "false")])
    assert done.returncode == 0, done.stderr[-2000:]
    assert last_checkpoint(tmp_path / "run")["global_step"] == 2
    assert not (tmp_path / "run" / "csv").exists()


GRAPHORMER_URPE = Path(sys.executable).with_name("graphormer-urpe")


@pytest.fixture(scope="module")
def fit_then_resumed(zinc_root, tmp_path_factory):
    """A 4-step fit through the installed command, with its progress bar, then the same run
    resumed to 8 steps (``--ckpt_path last``): the run directory and each command's output."""
    root = tmp_path_factory.mktemp("fit_report")
    (root / "ZINC").symlink_to(zinc_root, target_is_directory=True)
    run_dir = root / "run"
    done = []
    for steps, resume in (("4", []), ("8", ["--ckpt_path", "last"])):
        args = zinc_args(run_dir, root, "--trainer.max_steps", steps, "--trainer.enable_progress_bar", "true",
                         "--trainer.val_check_interval", "2", *resume)
        done.append(subprocess.run([str(GRAPHORMER_URPE), "fit", *args], capture_output=True, text=True,
                                   timeout=600, cwd=root))
        assert done[-1].returncode == 0, done[-1].stderr[-3000:]
    return run_dir, done


def test_every_fit_ends_with_its_summary(fit_then_resumed):
    run_dir, done = fit_then_resumed
    recorded = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    callback = next(v for k, v in recorded["callbacks"].items() if "best_model_path" in v)
    for steps, result in zip((4, 8), done):
        title, steps_line, wall, best, last = result.stdout.splitlines()[-5:]
        assert title == f"=== graphormer-urpe fit: {run_dir} ==="
        assert steps_line.startswith(f"optimizer steps   {steps} (epoch ")
        assert wall.startswith("wall time         ") and wall.endswith(" min")
        assert best.startswith(f"best checkpoint   {run_dir / 'checkpoints'}/epoch=")
        assert last == f"last checkpoint   {run_dir / 'checkpoints' / 'last.ckpt'}"
    best_path, score = best[len("best checkpoint   "):].rsplit(" (val/mae ", 1)
    assert Path(best_path).is_file() and Path(best_path) == Path(callback["best_model_path"])
    assert float(score.rstrip(")")) == pytest.approx(float(callback["best_model_score"]), abs=1e-4)


def test_the_progress_bar_says_how_long_the_run_has_left(fit_then_resumed):
    _, done = fit_then_resumed
    assert "run_left=" in done[0].stdout, done[0].stdout[-2000:]  # Lightning's bar writes to stdout


def test_a_resumed_fit_logs_into_the_version_it_started_in(fit_then_resumed):
    import csv

    import yaml

    run_dir, _ = fit_then_resumed
    assert sorted(p.name for p in (run_dir / "tensorboard").iterdir()) == ["version_0"]
    assert sorted(p.name for p in (run_dir / "csv").iterdir()) == ["version_0"]
    with open(run_dir / "csv" / "version_0" / "metrics.csv", newline="") as file:
        steps = {int(row["step"]) for row in csv.DictReader(file) if row.get("val/mae")}
    assert min(steps) < 4 <= max(steps)  # both runs' validations, one curve
    for logger in ("tensorboard", "csv"):  # plain YAML: the facts as a mapping
        hparams = yaml.safe_load((run_dir / logger / "version_0" / "hparams.yaml").read_text())
        assert hparams["facts"]["num_atom_embeddings"] == 29 and hparams["backbone"]["hidden_dim"] == 16


def test_plot_curves_draws_the_runs_csv_metrics(fit_then_resumed, tmp_path):
    run_dir, _ = fit_then_resumed
    out = tmp_path / "curves.png"
    result = subprocess.run([str(GRAPHORMER_URPE.with_name("graphormer-urpe-plot")), "curves", str(run_dir),
                             "-o", str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == [str(out)] and out.read_bytes()[:4] == b"\x89PNG"
    empty = subprocess.run([str(GRAPHORMER_URPE.with_name("graphormer-urpe-plot")), "curves", str(tmp_path)],
                           capture_output=True, text=True, timeout=300)
    assert empty.returncode == 2 and empty.stderr.strip().splitlines() == [
        f"graphormer-urpe-plot: error: {tmp_path}: no csv/version_N/metrics.csv here (give a run directory, "
        "--trainer.default_root_dir of a fit, or a metrics.csv)"]

"""The shipped pretrained backbone and the path that makes one, through the installed commands on
real molecules: pretrain on RDKit descriptors, export weights only, fine-tune a CSV from the file
or from ``pretrained:<name>``."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from graphormer_urpe.cli import export as export_command
from graphormer_urpe.prediction import pretrained

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TINY = {"num_layers": 2, "hidden_dim": 16, "ffn_dim": 16, "num_heads": 2, "dropout": 0.0,
        "attention_dropout": 0.0, "activation_dropout": 0.0}
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]


def run(*command, ok: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in command], cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=600)
    if ok:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


def csv_fit(run_dir: Path, esol: Path, *extra) -> list:
    return [BIN / "graphormer-urpe", "fit", "--config", "configs/csv.yaml", *QUIET,
            "--trainer.default_root_dir", run_dir, "--data.init_args.path", esol,
            "--data.init_args.cache_root", run_dir.parent / "cache", "--trainer.limit_val_batches", "1", *extra]


def fit_here(run_main, caplog, *command) -> tuple[int, str]:
    """A ``graphormer-urpe`` command of :func:`csv_fit` run by its ``main()`` in this process:
    its exit status and what it wrote to stderr and logged."""
    from graphormer_urpe.cli.fit import main as cli_main

    caplog.clear()
    with caplog.at_level("INFO", logger="graphormer_urpe"):
        done = run_main(cli_main, command[1:])
    return done.returncode, done.stderr + caplog.text


def backbone_of(ckpt: Path) -> dict[str, torch.Tensor]:
    state = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    return {k.removeprefix("model."): v for k, v in state.items()
            if k.startswith("model.") and not k.startswith("model.head.")}


def assert_backbone_is(ckpt: Path, source: dict[str, torch.Tensor]) -> None:
    tuned = backbone_of(ckpt)
    assert len(tuned) > 20 and set(tuned) == {k for k in source if not k.startswith("head.")}
    for name, tensor in tuned.items():
        torch.testing.assert_close(tensor, source[name], rtol=0, atol=0, msg=name)


def test_pretrain_on_descriptors_export_and_fine_tune_a_csv(zinc_source, esol_csv, tmp_path):
    with gzip.open(zinc_source / "jtvae_train.smi.gz", "rt") as f:
        (tmp_path / "zinc.smi").write_text("".join(next(f) for _ in range(400)))
    pre = tmp_path / "pre"
    run(BIN / "graphormer-urpe", "fit", "--config", "configs/pretrain_descriptors.yaml", *QUIET,
        "--trainer.default_root_dir", pre, "--data.init_args.path", tmp_path / "zinc.smi",
        "--data.init_args.cache_root", tmp_path / "cache", "--data.init_args.build_workers", "1",
        "--model.backbone", json.dumps(TINY), "--trainer.max_steps", "4", "--trainer.val_check_interval", "2",
        "--model.warmup_steps", "1")
    exported = tmp_path / "backbone.pt"
    done = run(Path(sys.executable).with_name("graphormer-urpe-export"), pre / "checkpoints" / "last.ckpt", exported)
    assert f"{exported}:" in done.stdout
    content = torch.load(exported, map_location="cpu", weights_only=True)  # plain data, no code
    assert content["trained"]["global_step"] == 4 and content["hyper_parameters"]["facts"]["featurizer"] == "ogb"
    assert content["state_dict"]["head.weight"].shape[0] == len(content["hyper_parameters"]["target_names"]) > 150

    tuned = tmp_path / "ft"
    fit = run(*csv_fit(tuned, esol_csv, "--model.init_from", exported, "--model.backbone", json.dumps(TINY),
                       "--model.freeze_backbone_steps", "2", "--trainer.max_steps", "2"))
    assert f"init_from {exported}: loaded" in fit.stderr and "output head re-initialised" in fit.stderr
    assert_backbone_is(tuned / "checkpoints" / "last.ckpt", content["state_dict"])


def test_the_csv_recipe_starts_from_the_shipped_backbone(esol_csv, tmp_path, run_main, caplog, monkeypatch):
    shipped = pretrained.resolve("pretrained:zinc-descriptors")
    assert shipped.is_file() and shipped.stat().st_size <= 10 * 2 ** 20
    content = torch.load(shipped, map_location="cpu", weights_only=True)
    tuned = tmp_path / "ft"
    fit = run(*csv_fit(tuned, esol_csv, "--model.freeze_backbone_steps", "1", "--trainer.max_steps", "1"))
    assert "init_from pretrained:zinc-descriptors: loaded" in fit.stderr
    assert_backbone_is(tuned / "checkpoints" / "last.ckpt", content["state_dict"])
    # and from scratch with the same recipe (main() in this process)
    monkeypatch.chdir(REPO)
    status, said = fit_here(run_main, caplog, *csv_fit(tmp_path / "scratch", esol_csv, "--model.init_from", "null",
                                                       "--trainer.max_steps", "1"))
    assert status == 0 and "init_from" not in said, said[-3000:]


def test_an_unknown_shipped_name_is_one_line(esol_csv, tmp_path, run_main, caplog, monkeypatch):
    monkeypatch.chdir(REPO)
    status, said = fit_here(run_main, caplog, *csv_fit(tmp_path / "ft", esol_csv, "--model.init_from", "pretrained:nope",
                                                       "--trainer.max_steps", "1"))
    assert status == 2 and "Traceback" not in said
    assert "model.init_from: no shipped backbone 'nope' (shipped: pretrained:zinc-descriptors)" in said


def test_resolve_leaves_paths_alone():
    assert pretrained.resolve("runs/a/last.ckpt") == Path("runs/a/last.ckpt")
    with pytest.raises(ValueError, match="no shipped backbone"):
        pretrained.resolve("pretrained:")


def test_export_onto_a_full_disk_is_one_line_and_keeps_the_previous_file(esol_csv, tmp_path):
    """``graphormer-urpe-export`` writing onto a real disk (a tmpfs) with room for
    half of the export: one line naming the full disk, exit status 1, no traceback (torch.save to
    a path said only ``unexpected pos``), the previous export byte for byte, no temporary file."""
    from helpers.small_disk import pages, small_disk

    run(*csv_fit(tmp_path / "run", esol_csv, "--model.init_from", "null", "--model.backbone", json.dumps(TINY),
                 "--trainer.max_steps", "1", "--model.warmup_steps", "0"))
    checkpoint = tmp_path / "run" / "checkpoints" / "last.ckpt"
    run(Path(sys.executable).with_name("graphormer-urpe-export"), checkpoint, tmp_path / "measured.pt")
    size = (tmp_path / "measured.pt").stat().st_size
    previous = (tmp_path / "measured.pt").read_bytes()
    with small_disk(tmp_path / "disk", pages(len(previous)) + size // 2) as disk:
        (disk / "backbone.pt").write_bytes(previous)
        done = run(Path(sys.executable).with_name("graphormer-urpe-export"), checkpoint, disk / "backbone.pt", ok=False)
        assert done.returncode == 1, done.stderr[-3000:]
        assert done.stderr.strip().splitlines() == [
            f"{export_command.PROG}: error: [Errno 28] No space left on device; outputs not yet written are left "
            "as they were"]
        assert (disk / "backbone.pt").read_bytes() == previous
        assert [p.name for p in disk.iterdir()] == ["backbone.pt"]

"""``graphormer-urpe-submit`` end to end, for PCQM4M (v1) and PCQM4Mv2: a tiny model fitted by the
CLI (``configs/pcqm4m.yaml`` / ``configs/pcqm4mv2.yaml``) on an OGB-format fixture of real molecules
with the official test split sizes writes the submission files OGB's evaluator expects; bad input
is refused with one line and exit status 2, writing nothing."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from graphormer_urpe.cli import submit
from graphormer_urpe.data.ogb_lsc import PCQM4M, PCQM4MV2, RAW_TABLE, SPLIT_FILE, read_split_dict, write_root
from graphormer_urpe.cli.fit import main as cli_main
from graphormer_urpe.data.facts import DataFacts
from graphormer_urpe.training.module import GraphormerModule

REPO = Path(__file__).resolve().parents[1]
#: The installed console script beside this interpreter (``pip install -e .`` puts it there).
SUBMIT = Path(sys.executable).with_name("graphormer-urpe-submit")
TINY = json.dumps({"num_layers": 1, "hidden_dim": 16, "ffn_dim": 16, "num_heads": 2})
TRAIN_VALID = {"train": 1200, "valid": 400}
DATASETS = {"pcqm4m": (PCQM4M, "pcqm4m.yaml"), "pcqm4mv2": (PCQM4MV2, "pcqm4mv2.yaml")}


def fit_fixture(work: Path, source: Path, dataset: str) -> Path:
    """Fit 2 steps through the CLI with the dataset's config on a fixture root with the official
    test sizes; returns the checkpoint."""
    layout, config = DATASETS[dataset]
    sizes = {**TRAIN_VALID, **{s: layout.split_sizes[s] for s in layout.test_splits}}
    write_root(work / "root", source, layout, split_sizes=sizes)
    cli_main([
        "fit", "--config", str(REPO / "configs" / config),
        "--trainer.default_root_dir", str(work / "run"),
        "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
        "--trainer.limit_val_batches", "1", "--trainer.precision", "32-true",
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        "--model.backbone", TINY,
        "--data.init_args.root", str(work / "root"), "--data.init_args.batch_size", "32",
        "--data.init_args.max_hops", "1",  # the submission's format is under test, not the recipe
    ])
    return work / "run" / "checkpoints" / "last.ckpt"


@pytest.fixture(scope="module")
def fitted_v1(pcqm_source, tmp_path_factory) -> tuple[Path, Path]:
    work = tmp_path_factory.mktemp("pcqm4m")
    return work, fit_fixture(work, pcqm_source, "pcqm4m")


def run_submit(*args: str) -> subprocess.CompletedProcess:
    assert SUBMIT.is_file(), f"{SUBMIT} is not installed (pip install -e .)"
    return subprocess.run([str(SUBMIT), *map(str, args), "--batch-size", "4096"],
                          capture_output=True, text=True, timeout=900)


def assert_split_order(pred: np.ndarray, smiles: np.ndarray) -> None:
    """Rows holding the same molecule get the same prediction (so predictions are in split
    order) and different molecules differ."""
    first = pd.Series(pred).groupby(smiles).transform("first").to_numpy()
    np.testing.assert_allclose(pred, first, rtol=1e-5, atol=1e-6)
    assert len(np.unique(np.round(pred, 5))) > 100


def test_pcqm4m_config_trains_through_the_cli(fitted_v1):
    _, ckpt = fitted_v1
    checkpoint = torch.load(ckpt, weights_only=True)
    assert checkpoint["global_step"] == 2
    hparams = checkpoint["hyper_parameters"]
    assert (hparams["preset"], hparams["facts"]["featurizer"],
            hparams["facts"]["num_atom_embeddings"]) == ("small", "ogb", 175)
    assert (hparams["lr"], hparams["warmup_steps"], hparams["total_steps"]) == (2e-4, 60_000, 1_000_000)


@pytest.mark.parametrize("overlay, attention, parameters, run_dir", [
    ([], "urpe", 9_942_177, "runs/pcqm4m_urpe"),
    (["--config", str(REPO / "configs" / "rpe.yaml"), "--trainer.default_root_dir", "runs/pcqm4m_rpe"],
     "rpe", 9_843_681, "runs/pcqm4m_rpe"),
])
def test_pcqm4m_config_is_graphormer_small_and_rpe_yaml_is_its_ablation(overlay, attention, parameters, run_dir):
    from graphormer_urpe.nn.graphormer import count_parameters
    from graphormer_urpe.training.lightning_cli import build_cli

    cli = build_cli(["--config", str(REPO / "configs" / "pcqm4m.yaml"), *overlay], run=False)
    assert type(cli.datamodule).__name__ == "PCQM4MDataModule" and cli.datamodule.batch_size == 256
    assert cli.model.model.attention == attention and len(cli.model.model.layers) == 6
    assert count_parameters(cli.model.model) == parameters  # the full small preset (docs/model.md)
    assert cli.config.trainer.default_root_dir == run_dir


@pytest.mark.slow
def test_pcqm4m_submission(fitted_v1):
    work, ckpt = fitted_v1
    out_dir = work / "submission"
    result = run_submit("--dataset", "pcqm4m", "--ckpt", ckpt, "--root", work / "root", "--out-dir", out_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["test_count"] == 377_423 and summary["files"] == ["y_pred_pcqm4m.npz"]
    pred = np.load(out_dir / "y_pred_pcqm4m.npz")["y_pred"]
    assert pred.shape == (377_423,) and pred.dtype == np.float32 and np.isfinite(pred).all()
    smiles = pd.read_csv(PCQM4M.path(work / "root") / RAW_TABLE)["smiles"].to_numpy()
    assert_split_order(pred, smiles[read_split_dict(work / "root", PCQM4M)["test"]])
    # the valid MAE is OGB's PCQM4MEvaluator on the real gaps of the valid rows
    assert 0.0 < summary["valid_mae"] < 20.0 and summary["valid_count"] == 400
    assert "note: train has 1,200 rows (official PCQM4M: 3,045,360)" in result.stderr


@pytest.mark.slow
def test_pcqm4mv2_submission(pcqm_source, tmp_path, run_main):
    """As v1's, with ``main()`` in this process (v1's test runs the installed command)."""
    ckpt = fit_fixture(tmp_path, pcqm_source, "pcqm4mv2")
    out_dir = tmp_path / "submission"
    result = run_main(submit.main, ["--dataset", "pcqm4mv2", "--ckpt", ckpt, "--root", tmp_path / "root",
                                    "--out-dir", out_dir, "--batch-size", "4096"])
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["test-dev_count"] == 147_037 and summary["test-challenge_count"] == 147_432
    smiles = pd.read_csv(PCQM4MV2.path(tmp_path / "root") / RAW_TABLE)["smiles"].to_numpy()
    splits = read_split_dict(tmp_path / "root", PCQM4MV2)
    for split, size in (("test-dev", 147_037), ("test-challenge", 147_432)):
        pred = np.load(out_dir / f"y_pred_pcqm4m-v2_{split}.npz")["y_pred"]
        assert pred.shape == (size,) and np.isfinite(pred).all()
        assert_split_order(pred, smiles[splits[split]])
    assert 0.0 < summary["valid_mae"] < 20.0 and summary["valid_count"] == TRAIN_VALID["valid"]


def _foreign_checkpoint(path: Path, problem: str, fitted: Path) -> None:
    if problem == "zinc model":
        zinc = GraphormerModule(DataFacts(num_atom_embeddings=29, num_bond_embeddings=5, featurizer="zinc"),
                                backbone=json.loads(TINY))
        torch.save({"state_dict": zinc.state_dict(), "hyper_parameters": dict(zinc.hparams)}, path)
    elif problem == "non-finite predictions":
        # finite weights whose outputs overflow float32: the valid MAE would be inf / nan
        checkpoint = torch.load(fitted, weights_only=True)
        checkpoint["state_dict"]["model.head.weight"].fill_(3e38)
        checkpoint["state_dict"]["model.head.bias"].fill_(3e38)
        torch.save(checkpoint, path)


def _bad_split_dict(root: Path, problem: str) -> None:
    splits = read_split_dict(root, PCQM4M)
    train, test = splits["train"], splits["test"]
    splits["test"] = {"negative test rows": np.r_[test[:-1], -5],
                      "test overlaps train": np.r_[test[:-3], train[:3]],
                      "short test set": test[:-1]}[problem]
    torch.save(splits, PCQM4M.path(root) / SPLIT_FILE)


REFUSALS = {
    "missing checkpoint": "checkpoint .* does not exist",
    "zinc model": "featurizer 'zinc'",
    "non-finite predictions": r"valid MAE is (nan|inf): 400 of 400 valid predictions are not finite",
    "root is not a directory": "--root .* is not a directory",
    "root without the v1 folder": r"PCQM4M file\(s\) missing: .*pcqm4m_kddcup2021/raw/data.csv.gz",
    "negative test rows": r"'test' has negative rows, e.g. \[-5\]",
    "test overlaps train": "splits 'train' and 'test' share 3 rows",
    "short test set": "'test' has 377,422 rows; the official PCQM4M test set has 377,423",
    "damaged table": r"data.csv.gz cannot be read as an OGB-LSC table .*\((BadGzipFile|EOFError|OSError)",
}


@pytest.mark.parametrize("problem", REFUSALS)
def test_refusals_are_one_line_exit_2_and_write_nothing(fitted_v1, tmp_path, capsys, problem):
    work, ckpt = fitted_v1
    root = work / "root"
    if problem in ("missing checkpoint", "zinc model", "non-finite predictions"):
        ckpt = tmp_path / "model.ckpt"
        _foreign_checkpoint(ckpt, problem, fitted_v1[1])
    elif problem == "root is not a directory":
        root = tmp_path / "nowhere"
    elif problem == "root without the v1 folder":
        root = tmp_path
    else:
        root = tmp_path / "root"
        shutil.copytree(work / "root", root)  # featurized molecules included: only one file differs
        if problem == "damaged table":
            table = PCQM4M.path(root) / RAW_TABLE
            table.write_bytes(table.read_bytes()[:5000])  # a truncated download
        else:
            _bad_split_dict(root, problem)
    out_dir = tmp_path / "out"
    status = submit.main(["--dataset", "pcqm4m", "--ckpt", str(ckpt), "--root", str(root),
                          "--out-dir", str(out_dir), "--batch-size", "4096"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2
    assert err[-1].startswith("graphormer-urpe-submit: error: ")
    assert re.search(REFUSALS[problem], err[-1]), err[-1]
    assert not out_dir.exists()


def test_usage_errors_exit_2(capsys):
    for argv in (["--dataset", "pcqm5m", "--ckpt", "x", "--root", "x", "--out-dir", "x"],
                 ["--dataset", "pcqm4m", "--ckpt", "x", "--root", "x", "--out-dir", "x", "--batch-size", "0"]):
        with pytest.raises(SystemExit) as exit_info:
            submit.main(argv)
        assert exit_info.value.code == 2
    assert "--batch-size: must be >= 1" in capsys.readouterr().err


def test_the_files_of_a_submission_are_put_in_place_together(tmp_path, monkeypatch):
    """OGB's own PCQM4Mv2 evaluator writes the two test sets' files; they replace the previous
    submission together. A failure while the second is written (a stop, a full disk) leaves the
    previous files byte for byte and no temporary behind, never one new file beside an old one."""
    import ogb.lsc

    from graphormer_urpe.training.submission import write_submission

    evaluator = ogb.lsc.PCQM4Mv2Evaluator()
    sizes = {split: PCQM4MV2.split_sizes[split] for split in PCQM4MV2.test_splits}
    out_dir = tmp_path / "submission"

    def preds(value: float) -> dict[str, np.ndarray]:
        return {split: np.full(size, value, dtype=np.float32) for split, size in sizes.items()}

    files = write_submission(evaluator, preds(1.0), out_dir, by_mode=True)
    assert files == ["y_pred_pcqm4m-v2_test-challenge.npz", "y_pred_pcqm4m-v2_test-dev.npz"]
    before = {name: (out_dir / name).read_bytes() for name in files}

    save, calls = evaluator.save_test_submission, []

    def fail_on_the_second(*args, **kwargs):
        calls.append(kwargs["mode"])
        if len(calls) == 2:
            raise KeyboardInterrupt  # as a Ctrl-C there would
        return save(*args, **kwargs)

    monkeypatch.setattr(evaluator, "save_test_submission", fail_on_the_second)
    with pytest.raises(KeyboardInterrupt):
        write_submission(evaluator, preds(2.0), out_dir, by_mode=True)
    assert {p.name: p.read_bytes() for p in out_dir.iterdir()} == before
    monkeypatch.undo()

    write_submission(evaluator, preds(3.0), out_dir, by_mode=True)
    assert sorted(p.name for p in out_dir.iterdir()) == files
    for name in files:
        assert (np.load(out_dir / name)["y_pred"] == 3.0).all()


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_submission_stopped_while_it_predicts_leaves_the_previous_files(fitted_v1, tmp_path, signum):
    """SIGTERM (a scheduler) or Ctrl-C to ``graphormer-urpe-submit`` once it predicts the test
    set: one line, exit status 128 + the signal, no traceback, and the output folder as it was
    (the previous submission byte for byte, no temporary)."""
    work, ckpt = fitted_v1
    out_dir = tmp_path / "submission"
    out_dir.mkdir()
    previous = out_dir / "y_pred_pcqm4m.npz"
    previous.write_bytes(b"the previous submission")
    process = subprocess.Popen([str(SUBMIT), "--dataset", "pcqm4m", "--ckpt", str(ckpt), "--root",
                                str(work / "root"), "--out-dir", str(out_dir)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    for line in process.stdout:  # the valid set is predicted: the test set is next
        if line.startswith("valid MAE"):
            break
    os.killpg(process.pid, signum)
    out, err = process.communicate(timeout=300)
    said = "Ctrl-C (SIGINT)" if signum == signal.SIGINT else signal.Signals(signum).name
    assert process.returncode == 128 + signum, out[-2000:] + err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == (f"graphormer-urpe-submit: stopped by {said}; outputs not yet "
                                            "written are left as they were")
    assert [p.name for p in out_dir.iterdir()] == [previous.name]
    assert previous.read_bytes() == b"the previous submission"

"""Molecule descriptors beside the learned readout (``--data.init_args.molecule_descriptors
true``) on real ESOL molecules: the shipped backbone fine-tunes with them, the checkpoint keeps
the training split's statistics, and the prediction command and the Python API give the numbers
of the trained module on the split's molecules; a model without them is the plain head."""
from __future__ import annotations

import csv
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import graphormer_urpe as gu
from graphormer_urpe.data import CSVDataModule
from graphormer_urpe.data import descriptors
from graphormer_urpe.data.descriptors import clip_statistics, descriptor_names, raw_descriptors
from graphormer_urpe.prediction.load import load_module
from graphormer_urpe.prediction.model import predict_smiles
from graphormer_urpe.prediction.table import InputRow
from graphormer_urpe.training.module import load_training_module
from test_pretrained import csv_fit, run

BIN = Path(sys.executable).parent
ESOL_TARGET = "measured log solubility in mols per litre"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tuned(esol_csv, tmp_path_factory) -> tuple[Path, Path]:
    """``(best checkpoint, run directory)`` of a short fine-tuning of the shipped backbone with
    descriptors (20 steps, validated every 10)."""
    run_dir = tmp_path_factory.mktemp("descriptors") / "run"
    fit = run(*csv_fit(run_dir, esol_csv, "--data.init_args.molecule_descriptors", "true",
                       "--trainer.max_steps", "20", "--trainer.val_check_interval", "10",
                       "--trainer.limit_val_batches", "1.0", "--data.init_args.build_workers", "1"))
    assert "init_from pretrained:zinc-descriptors: loaded" in fit.stderr
    assert "output head re-initialised" in fit.stderr
    best = next(p for p in (run_dir / "checkpoints").glob("epoch=*.ckpt"))
    return best, run_dir


def data_of(esol_csv: Path, run_dir: Path) -> CSVDataModule:
    return CSVDataModule(path=str(esol_csv), cache_root=str(run_dir.parent / "cache"),
                         target_columns=[ESOL_TARGET], molecule_descriptors=True, build_workers=1,
                         encode_threads=1)


def module_predictions(module, loader) -> tuple[np.ndarray, np.ndarray]:
    """``(predictions [R], targets [R])`` of the trained module over a loader, in split order."""
    predictions, targets = [], []
    module.eval()
    with torch.inference_mode():
        for batch in loader:
            predictions.append(module(batch)[:, 0].numpy())
            targets.append(batch.y[:, 0].numpy())
    return np.concatenate(predictions), np.concatenate(targets)


def test_the_checkpoint_keeps_the_training_splits_statistics_and_predicts_as_the_module(esol_csv, tuned, tmp_path):
    best, run_dir = tuned
    data = data_of(esol_csv, run_dir)
    data.setup("fit")
    data.setup("test")
    state = torch.load(best, map_location="cpu", weights_only=True)
    assert state["hyper_parameters"]["facts"]["num_descriptors"] == len(descriptor_names())
    # the statistics are those of the training rows' descriptors, computed afresh here
    smiles = data._read()[0]
    train = [smiles[row] for row in data.store()[3]["train"]]
    expected = clip_statistics(np.concatenate(list(raw_descriptors(train, num_workers=1))))
    saved = state["state_dict"]["model.head.statistics"].numpy()
    np.testing.assert_allclose(saved, np.stack(expected).astype(np.float32), rtol=1e-6)
    everything = clip_statistics(np.concatenate(list(raw_descriptors(smiles, num_workers=1))))
    assert not np.allclose(saved[2], everything[2])  # not the whole file's

    module = load_training_module(best)
    # the validation loop's metric, from the module's predictions on the validation split
    predicted, measured = module_predictions(module, data.val_dataloader())
    val_mae = float(re.search(r"val_mae=([0-9.]+)\.ckpt", best.name).group(1))
    assert abs(np.mean(np.abs(predicted - measured)) - val_mae) < 1e-4
    # the test split's molecules through the command and the API
    predicted, _ = module_predictions(module, data.test_dataloader())
    test_smiles = data.predict_smiles()
    source = tmp_path / "test.csv"
    with open(source, "w", newline="") as f:
        csv.writer(f).writerows([["smiles"], *([s] for s in test_smiles)])
    run(BIN / "graphormer-urpe-predict", "--ckpt", best, "--input", source, "--output", tmp_path / "out.csv",
        "--quiet")
    with open(tmp_path / "out.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [row["error"] for row in rows] == [""] * len(test_smiles)
    command = np.array([float(row[f"prediction_{ESOL_TARGET}"]) for row in rows])
    np.testing.assert_allclose(command, predicted, rtol=1e-5, atol=1e-5)
    api = gu.load(best).predict(test_smiles)[f"prediction_{ESOL_TARGET}"].to_numpy()
    np.testing.assert_allclose(api, predicted, rtol=0, atol=1e-5)


def test_a_molecule_without_descriptors_gets_its_error_row(tuned, esol_csv, monkeypatch):
    """A molecule RDKit reads but computes no descriptor of gets the reason in its row; the
    others are predicted as before."""
    best, _ = tuned
    module = load_module(best)
    smiles = ["CCO", "c1ccccc1O", "CC(=O)Nc1ccc(O)cc1"]
    before = predict_smiles(module, [InputRow(s) for s in smiles])
    computed = descriptors.descriptor_chunk

    def none_for_phenol(batch):
        out = computed(batch)
        out[[s == "c1ccccc1O" for s in batch]] = np.nan
        return out

    monkeypatch.setattr(descriptors, "descriptor_chunk", none_for_phenol)
    rows = [InputRow(s) for s in smiles]
    after = predict_smiles(module, rows)
    assert [r.error or None for r in rows] == [None, "RDKit computes none of the molecule's descriptors", None]
    assert np.isnan(after[1]).all()
    np.testing.assert_allclose(after[[0, 2]], before[[0, 2]], rtol=0, atol=1e-6)


def test_a_model_without_descriptors_keeps_the_plain_head_and_an_old_checkpoint_loads():
    saved = torch.load(REPO / "tests" / "fixtures" / "previous_release_eager_step5.ckpt", map_location="cpu",
                       weights_only=True)
    assert "num_descriptors" not in saved["hyper_parameters"].get("facts", saved["hyper_parameters"])
    model = load_training_module(REPO / "tests" / "fixtures" / "previous_release_eager_step5.ckpt")
    assert model.model.num_descriptors == 0 and isinstance(model.model.head, torch.nn.Linear)
    heads = sorted(k for k in saved["state_dict"] if k.startswith("model.head."))
    assert heads == ["model.head.bias", "model.head.weight"]
    assert sorted(k for k in model.state_dict() if k.startswith("model.head.")) == heads

"""The Python API (``graphormer_urpe.load``, ``train``, the scikit-learn estimators) on real ESOL
molecules with tiny models: its predictions are ``graphormer-urpe-predict``'s, its fits are
``graphormer-urpe fit``'s runs, its refusals the command's lines, and ``docs/python.ipynb``
runs from top to bottom."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import graphormer_urpe as gu
from graphormer_urpe.cli.predict import main as predict_main
from graphormer_urpe.data import local_data
from graphormer_urpe.prediction.load import model_checkpoint_state
from graphormer_urpe.utils.torch_files import read_checkpoint

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ESOL_TARGET = "measured log solubility in mols per litre"
TINY = {"num_layers": 1, "hidden_dim": 16, "ffn_dim": 16, "num_heads": 2, "dropout": 0.1}
#: A fit of a few steps from scratch: one epoch of the table, no progress bar.
QUICK = {"model.init_from": None, "model.backbone": TINY, "trainer.max_epochs": 1,
         "trainer.enable_progress_bar": False, "trainer.enable_model_summary": False}
#: What the models are asked to predict: ESOL molecules and rows that get an error.
BAD = ["not a molecule", "", "C1CC", "C" * 600]  # the last: more atoms than max_nodes


@pytest.fixture(scope="module")
def esol_table(esol_csv) -> pd.DataFrame:
    return pd.read_csv(esol_csv)[["smiles", ESOL_TARGET]].head(120).reset_index(drop=True)


@pytest.fixture(scope="module")
def runs(esol_table, tmp_path_factory) -> list[gu.Run]:
    """Two tiny models fitted by :func:`graphormer_urpe.train` on 120 ESOL molecules, seeds 0 and 1."""
    work = tmp_path_factory.mktemp("runs")
    return [gu.train(esol_table, target=ESOL_TARGET, recipe="csv", out=work / f"seed{seed}",
                     overrides={**QUICK, "seed_everything": seed, "data.init_args.cache_root": str(work / "cache")})
            for seed in (0, 1)]


@pytest.fixture(scope="module")
def molecules(esol_csv) -> list[str]:
    esol = pd.read_csv(esol_csv)["smiles"]
    return [*esol.iloc[1000:1030], *BAD, *esol.iloc[1030:1040]]


def read_table(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_import_loads_neither_torch_nor_lightning():
    done = subprocess.run([sys.executable, "-c", "import sys, graphormer_urpe as gu; gu.__all__; "
                           "print(sorted(m for m in ('torch', 'lightning', 'pandas', 'rdkit') if m in sys.modules))"],
                          capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_train_returns_the_best_checkpoint_its_logged_metrics_and_the_model(runs):
    run = runs[0]
    assert run.best_checkpoint.is_file() and run.best_checkpoint.parent == run.dir / "checkpoints"
    state = model_checkpoint_state(read_checkpoint(run.dir / "checkpoints" / "last.ckpt"), "val/mae")
    assert Path(state["best_model_path"]).name == run.best_checkpoint.name
    logged = pd.read_csv(next(run.dir.glob("csv/version_*/metrics.csv")))
    validation = logged.dropna(subset=["val/mae"])
    assert len(validation) == 1  # one epoch: one validation
    assert run.metrics == {"val/loss": validation["val/loss"].iloc[0], "val/mae": validation["val/mae"].iloc[0]}
    assert run.metrics["val/mae"] == pytest.approx(float(state["best_model_score"]))
    assert f"val_mae={run.metrics['val/mae']:.4f}" in run.best_checkpoint.name
    assert run.model.checkpoints == [run.best_checkpoint] and run.model.columns == [f"prediction_{ESOL_TARGET}"]
    # the DataFrame was written into the run, and the run's config names it
    table, = run.dir.glob("data-*.csv")
    assert str(table) in (run.dir / "tensorboard" / "version_0" / "config.yaml").read_text()


def test_predictions_are_the_commands_with_error_rows_and_ensemble_std(runs, molecules, tmp_path):
    source = tmp_path / "in.csv"
    pd.DataFrame({"id": range(len(molecules)), "smiles": molecules}).to_csv(source, index=False)
    done = subprocess.run([BIN / "graphormer-urpe-predict", "--ckpt", runs[0].dir, runs[1].dir, "--input", source,
                           "--output", tmp_path / "out.csv", "--quiet"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    expected = read_table(tmp_path / "out.csv")

    model = gu.load([runs[0].dir, runs[1].dir])
    frame = pd.DataFrame({"id": range(len(molecules)), "smiles": molecules}, index=[f"m{i}" for i in range(len(molecules))])
    got = model.predict(frame)
    columns = [f"prediction_{ESOL_TARGET}", f"std_{ESOL_TARGET}"]
    assert list(got.columns) == ["id", "smiles", *columns, "error"] and list(got.index) == list(frame.index)
    assert [row["error"] for row in expected] == list(got["error"])
    assert sum(bool(error) for error in got["error"]) == len(BAD)
    for column in columns:
        assert [row[column] for row in expected] == ["" if np.isnan(v) else f"{v:.6g}" for v in got[column]]
    assert (got[f"std_{ESOL_TARGET}"].dropna() > 0).all()
    # a list of SMILES: the same numbers
    listed = model.predict(molecules)
    assert list(listed.columns) == ["smiles", *columns, "error"]
    np.testing.assert_array_equal(listed[columns].to_numpy(), got[columns].to_numpy())


def test_mc_dropout_calibration_and_embeddings_are_the_commands(runs, molecules, esol_csv, tmp_path, run_main):
    ckpt, source = runs[0].best_checkpoint, tmp_path / "in.smi"
    source.write_text("\n".join(molecules) + "\n")
    calibration = pd.read_csv(esol_csv).iloc[1050:1080]
    calibration.to_csv(tmp_path / "val.csv", index=False)
    done = run_main(predict_main, ["--ckpt", ckpt, "--input", source, "--output", tmp_path / "out.csv", "--quiet",
                                   "--mc-dropout", "4", "--seed", "3", "--calibrate", tmp_path / "val.csv", "--workers", "0"])
    assert done.returncode == 0, done.stderr
    expected = read_table(tmp_path / "out.csv")
    got = runs[0].model.predict(molecules, mc_dropout=4, seed=3, calibrate=calibration)
    for column in (f"prediction_{ESOL_TARGET}", f"std_{ESOL_TARGET}"):
        assert [row[column] for row in expected] == ["" if np.isnan(v) else f"{v:.6g}" for v in got[column]]

    done = run_main(predict_main, ["--ckpt", ckpt, "--input", source, "--output", tmp_path / "out.csv", "--quiet",
                                   "--embeddings", tmp_path / "e.npy", "--atom-embeddings", tmp_path / "a.npz"])
    assert done.returncode == 0, done.stderr
    vectors = runs[0].model.embed(molecules)
    np.testing.assert_array_equal(vectors, np.load(tmp_path / "e.npy"))
    assert np.isnan(vectors[30:34]).all() and np.isfinite(np.delete(vectors, range(30, 34), axis=0)).all()
    atoms, saved = runs[0].model.embed_atoms(molecules), np.load(tmp_path / "a.npz")
    offsets = saved["offsets"]
    for k, row in enumerate(atoms):
        expected_atoms = saved["embeddings"][offsets[k]:offsets[k + 1]]
        assert (row is None and not len(expected_atoms)) or np.array_equal(row, expected_atoms)


def test_bad_input_is_one_clear_error_before_any_work(esol_table, esol_csv, runs, tmp_path):
    cache = {"data.init_args.cache_root": str(tmp_path / "cache")}
    cases = [
        (dict(data=esol_table, target=ESOL_TARGET, recipe="no-such-recipe"), "--config no-such-recipe: no such file, nor a recipe"),
        (dict(data=esol_table, target="logS"), r"the DataFrame has no column\(s\) \['logS'\]"),
        (dict(data=esol_table, smiles="SMILES", target=ESOL_TARGET), r"the DataFrame has no column\(s\) \['SMILES'\]"),
        (dict(data=esol_csv, target="logS"), r"has no target column\(s\) \['logS'\]"),
        (dict(data=esol_table, target=ESOL_TARGET, overrides={"model.no_such_option": 1}),
         "unrecognized arguments: --model.no_such_option 1"),
        (dict(data=esol_table, target=ESOL_TARGET, out=runs[0].dir), "already holds checkpoints of a run"),
    ]
    for call, message in cases:
        data, out, overrides = call.pop("data"), call.pop("out", tmp_path / "run"), call.pop("overrides", {})
        with pytest.raises(ValueError, match=message):
            gu.train(data, **call, out=out, overrides={**QUICK, **cache, **overrides})
        assert not (tmp_path / "cache").exists() and not (tmp_path / "run" / "checkpoints").exists()
    with pytest.raises(ValueError, match=r"no column\(s\) \['SMILES'\]"):
        runs[0].model.predict(esol_table, smiles="SMILES")
    with pytest.raises(ValueError, match="checkpoint .*missing.ckpt"):
        gu.load(tmp_path / "missing.ckpt")
    with pytest.raises(ValueError, match="embeddings come from one model"):
        gu.load([runs[0].dir, runs[1].dir]).embed(["CCO"])


def test_estimators_clone_and_cross_validate_in_a_pipeline(esol_table):
    from sklearn.base import clone
    from sklearn.model_selection import cross_val_score
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import FunctionTransformer

    regressor = gu.GraphormerRegressor(overrides=QUICK, validation_fraction=0.2)
    copy = clone(regressor)
    assert copy is not regressor and copy.get_params() == regressor.get_params()
    assert copy.set_params(random_state=3).random_state == 3
    table = esol_table.head(90)
    scores = cross_val_score(make_pipeline(FunctionTransformer(np.ravel), regressor),
                             table[["smiles"]], table[ESOL_TARGET], cv=3)
    assert scores.shape == (3,) and np.isfinite(scores).all()
    assert not hasattr(regressor, "model_")  # cross_val_score fits clones

    labels = np.where(esol_table[ESOL_TARGET] > -3, "soluble", "insoluble")
    classifier = gu.GraphormerClassifier(overrides=QUICK).fit(esol_table["smiles"], labels)
    assert list(classifier.classes_) == ["insoluble", "soluble"] and classifier.run_dir_ is None
    proba = classifier.predict_proba(esol_table["smiles"][:5])
    assert proba.shape == (5, 2) and np.allclose(proba.sum(axis=1), 1)
    assert set(classifier.predict(esol_table["smiles"][:5])) <= {"insoluble", "soluble"}
    assert 0 <= classifier.score(esol_table["smiles"], labels) <= 1
    with pytest.raises(ValueError, match="cannot be predicted.*not a molecule"):
        classifier.predict(["CCO", "not a molecule"])


def test_the_blend_of_a_fine_tuned_model_and_the_fast_mode_is_their_mean(esol_table):
    """docs/python.md's blend: scikit-learn's VotingRegressor of a GraphormerRegressor and the fast
    mode's pipeline (its head chosen by GridSearchCV) fits both on SMILES and predicts their mean."""
    from sklearn.ensemble import VotingRegressor
    from sklearn.model_selection import GridSearchCV
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler
    from sklearn.svm import SVR

    smiles, y = esol_table["smiles"].to_numpy(), esol_table[ESOL_TARGET].to_numpy()
    fast = make_pipeline(gu.GraphormerEmbedder(), StandardScaler(), GridSearchCV(SVR(), {"C": [0.3, 1, 3, 10]}))
    blend = VotingRegressor([("fine-tuned", gu.GraphormerRegressor(overrides=QUICK)), ("fast", fast)])
    blend.fit(smiles[:100], y[:100])
    fine_tuned, fast_fitted = blend.estimators_
    parts = [fine_tuned.predict(smiles[100:]), fast_fitted.predict(smiles[100:])]
    assert not np.allclose(*parts)
    np.testing.assert_allclose(blend.predict(smiles[100:]), (parts[0] + parts[1]) / 2, rtol=1e-12)
    assert fast_fitted[-1].best_params_["C"] in (0.3, 1, 3, 10)


def test_the_notebook_runs_and_shows_what_it_says(esol_csv, tmp_path):
    """``docs/python.ipynb``'s code cells, in order, in a fresh process (from an empty folder, the
    data found as the package finds it), and the values its text promises."""
    data = tmp_path / "data"
    (data / "moleculenet").mkdir(parents=True)
    (data / local_data.ESOL).symlink_to(esol_csv)
    notebook = json.loads((REPO / "docs" / "python.ipynb").read_text())
    cells = ["".join(cell["source"]) for cell in notebook["cells"] if cell["cell_type"] == "code"]
    (tmp_path / "cells.json").write_text(json.dumps(cells))
    runner = ("import json, sys\nscope = {'__name__': '__main__'}\n"
              "for cell in json.load(open('cells.json')):\n    exec(compile(cell, 'cell', 'exec'), scope)\n"
              "print(json.dumps({'columns': list(scope['predictions'].columns), 'errors': int((scope['predictions']['error'] != '').sum()),"
              " 'rows': len(scope['predictions']), 'vectors': list(scope['vectors'].shape),"
              " 'tuned': scope['tuned'].best_checkpoint.is_file(), 'scores': len(scope['scores'])}))\n")
    done = subprocess.run([sys.executable, "-c", runner], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, local_data.DATA_ENV: str(data), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    shown = json.loads(done.stdout.strip().splitlines()[-1])
    assert shown["columns"] == ["smiles", f"prediction_{ESOL_TARGET}", f"std_{ESOL_TARGET}", "error"]
    assert shown["errors"] == 1 and shown["vectors"][0] == shown["rows"] and shown["tuned"] and shown["scores"] == 3


def test_the_embedder_is_the_models_vectors_and_descriptors_fitted_on_its_molecules(esol_table):
    """The fast mode's transformer: its first columns are ``Model.embed``'s vectors, the rest the
    molecules' RDKit descriptors standardized by the molecules ``fit`` saw (mean 0 on those, not
    on others); it fits a head in ``cross_val_score`` and names a molecule without a vector."""
    from sklearn.base import clone
    from sklearn.linear_model import Ridge
    from sklearn.model_selection import cross_val_score
    from sklearn.pipeline import make_pipeline

    from graphormer_urpe.data.descriptors import descriptor_names

    smiles, y = esol_table["smiles"].to_numpy(), esol_table[ESOL_TARGET].to_numpy()
    embedder = gu.GraphormerEmbedder().fit(smiles[:80])
    seen, unseen = embedder.transform(smiles[:80]), embedder.transform(smiles[80:])
    np.testing.assert_array_equal(gu.GraphormerEmbedder().fit_transform(smiles[:80]), seen)
    vectors = gu.load("pretrained:zinc-descriptors").embed(list(smiles[80:]))
    assert unseen.shape == (40, vectors.shape[1] + len(descriptor_names()))
    np.testing.assert_array_equal(unseen[:, :vectors.shape[1]], vectors)
    varied = seen[:, vectors.shape[1]:].std(0) > 0.1
    assert varied.sum() > 50
    # mean 0 before the 0.1-99.9 % clip moves it a little; the other molecules are off centre
    assert np.abs(seen[:, vectors.shape[1]:][:, varied].mean(0)).max() < 0.05
    assert np.abs(unseen[:, vectors.shape[1]:][:, varied].mean(0)).max() > 0.2
    assert clone(embedder).get_params() == {"checkpoint": "pretrained:zinc-descriptors", "descriptors": True,
                                            "device": None}
    assert gu.GraphormerEmbedder(descriptors=False).fit(smiles[:2]).transform(smiles[80:]).shape == vectors.shape

    scores = cross_val_score(make_pipeline(gu.GraphormerEmbedder(), Ridge(alpha=100.0)), smiles, y, cv=3,
                             scoring="neg_root_mean_squared_error")
    assert np.all(-scores < y.std())  # better than predicting the mean
    with pytest.raises(ValueError, match=r"1 of 3 molecules have no vector \('not a molecule'\)"):
        embedder.transform([smiles[0], "not a molecule", smiles[1]])

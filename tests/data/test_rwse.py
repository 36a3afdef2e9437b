"""RWSE, the random-walk structural encoding (``rwse_steps``): equal to PyG's ``AddRandomWalkPE`` on
real ZINC graphs, cached per parameter, embedded by the model, recorded in the checkpoint and
recomputed from it by ``graphormer-urpe-predict``; checkpoints without it load as before."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch_geometric.data import Data
from torch_geometric.transforms import AddRandomWalkPE

from graphormer_urpe.data.encodings import EncodingParams, random_walk_return_probabilities
from graphormer_urpe.cli.predict import main as predict_main
from graphormer_urpe.training.lightning_cli import build_cli
from graphormer_urpe.cli.fit import main as cli_main

REPO = Path(__file__).resolve().parents[2]
TINY_BACKBONE = {"num_layers": 1, "hidden_dim": 16, "ffn_dim": 16, "num_heads": 2}


def test_rwse_is_pygs_random_walk_pe_on_real_zinc(zinc_source):
    graphs = np.load(zinc_source / "subset_val_graphs.npz")
    node_ptr, edge_ptr = graphs["node_ptr"][:201], graphs["edge_ptr"][:201]
    edge_index = graphs["edge_index"][:, :edge_ptr[-1]]
    # graph 200: two components, one of them an isolated node (no walk: all zeros)
    node_ptr = np.append(node_ptr, node_ptr[-1] + 3)
    edge_index = np.concatenate([edge_index, [[0, 1], [1, 0]]], axis=1)
    edge_ptr = np.append(edge_ptr, edge_ptr[-1] + 2)
    rwse = random_walk_return_probabilities(node_ptr, edge_index, edge_ptr, 8)
    assert rwse.shape == (node_ptr[-1], 8) and rwse.dtype == np.float32
    for g in range(len(node_ptr) - 1):
        local = torch.from_numpy(edge_index[:, edge_ptr[g]:edge_ptr[g + 1]].astype(np.int64))
        n = int(node_ptr[g + 1] - node_ptr[g])
        expected = AddRandomWalkPE(walk_length=8)(Data(edge_index=local, num_nodes=n)).random_walk_pe
        np.testing.assert_allclose(rwse[node_ptr[g]:node_ptr[g + 1]], expected.numpy(), atol=1e-6)
    assert (rwse[-1] == 0).all() and (rwse[-3:-1, 1] == 1).all()  # a lone edge returns every 2 steps
    assert (rwse[:node_ptr[200], 0] == 0).all(), "no self-loops in molecules: never back after 1 step"


#: 3 training steps of a 1-layer model, one validation batch, quiet
SHORT_FIT = ["--trainer.max_steps", "3", "--trainer.limit_val_batches", "1", "--trainer.enable_progress_bar",
             "false", "--trainer.enable_model_summary", "false", "--model.warmup_steps", "1",
             "--model.backbone", json.dumps(TINY_BACKBONE)]


def _fit_esol(esol_csv: Path, run: Path, cache: Path, *extra: str):
    """``graphormer-urpe fit`` of ``configs/esol.yaml`` for :data:`SHORT_FIT`."""
    return build_cli(["fit", "--config", str(REPO / "configs" / "esol.yaml"), "--trainer.default_root_dir",
                      str(run), *SHORT_FIT, "--data.init_args.path", str(esol_csv),
                      "--data.init_args.cache_root", str(cache), *extra])


@pytest.fixture(scope="module")
def esol_rwse_run(esol_csv, tmp_path_factory):
    """A tiny model fitted on ESOL by the CLI with RWSE of 4 steps."""
    work = tmp_path_factory.mktemp("esol_rwse")
    return _fit_esol(esol_csv, work / "run", work / "cache", "--data.init_args.rwse_steps", "4"), work


def _predict_test_split(cli, ckpt: Path, work: Path, name: str) -> tuple[np.ndarray, np.ndarray]:
    """The predictions of ``graphormer-urpe-predict`` with ``ckpt`` on the test split's SMILES, and
    those of the DataModule's pipeline."""
    data = cli.datamodule
    expected = torch.cat([out["prediction"] for out in cli.trainer.predict(
        cli.model, datamodule=data, ckpt_path=str(ckpt))]).squeeze(1).numpy()
    source = work / f"{name}.smi"
    source.write_text("\n".join(data.predict_smiles()) + "\n")
    output = work / f"{name}.csv"
    assert predict_main(["--ckpt", str(ckpt), "--input", str(source), "--output", str(output), "--quiet"]) == 0
    import csv

    with open(output, newline="") as handle:
        rows = list(csv.DictReader(handle))
    column = next(c for c in rows[0] if c.startswith("prediction"))
    return np.array([float(r[column]) for r in rows]), expected


def test_rwse_run_is_cached_recorded_embedded_and_predicted_from_the_checkpoint(esol_rwse_run):
    cli, work = esol_rwse_run
    ckpt = work / "run" / "checkpoints" / "last.ckpt"
    folders = sorted(p.name for p in work.glob("cache/**/encodings/*") if not p.name.startswith("."))
    assert folders == ["molecules-k5", "molecules-rwse4"], folders
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert saved["hyper_parameters"]["facts"]["node_encodings"] == {"rwse": 4}
    assert saved["state_dict"]["model.node_encoders.rwse.weight"].shape == (16, 4)
    batch = next(iter(cli.datamodule.val_dataloader()))
    assert batch.rwse.shape == (*batch.node_mask.shape, 4) and (batch.rwse[~batch.node_mask] == 0).all()
    # the encoding reaches the output: without it (zeros) the predictions move
    model = cli.model.model.eval()
    with torch.no_grad():
        zeroed = type(batch).from_tensors({**batch.tensors(), "rwse": torch.zeros_like(batch.rwse)})
        assert not torch.allclose(model(batch), model(zeroed))

    got, expected = _predict_test_split(cli, ckpt, work, "rwse")
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)

    # model and data must agree on the encodings: a batch without RWSE is refused by name
    no_rwse = type(batch).from_tensors({k: v for k, v in batch.tensors().items() if k != "rwse"})
    with pytest.raises(ValueError, match=r"carries encodings \['degree', 'path_edges', 'spd'\] but the model "
                                         r"reads \['degree', 'path_edges', 'rwse', 'spd'\]"):
        model(no_rwse)


def test_a_checkpoint_of_other_encodings_is_refused_naming_the_option(esol_rwse_run, esol_csv, capsys):
    _, work = esol_rwse_run
    status = cli_main(["validate", "--config", str(REPO / "configs" / "esol.yaml"), *SHORT_FIT,
                       "--trainer.default_root_dir", str(work / "validate"), "--data.init_args.path", str(esol_csv),
                       "--data.init_args.cache_root", str(work / "cache"),
                       "--ckpt_path", str(work / "run" / "checkpoints" / "last.ckpt")])
    assert status == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "graphormer-urpe: error: the checkpoint was trained on data with max_hops=5, rwse_steps=4 but this "
        "data has max_hops=5, rwse_steps=0: run with --data.init_args.rwse_steps 4")


def test_a_checkpoint_without_encoding_fields_loads_as_before(esol_rwse_run, esol_csv, tmp_path):
    """Checkpoints written before ``node_encodings`` existed lack it: they rebuild the same model
    (no node encodings) and predict as before."""
    cli = _fit_esol(esol_csv, tmp_path / "run", esol_rwse_run[1] / "cache")
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)
    hparams = saved["hyper_parameters"]
    assert hparams["facts"]["node_encodings"] == {}
    old = tmp_path / "old.ckpt"
    facts = hparams.pop("facts")  # then each fact was a hyperparameter of its own
    del facts["node_encodings"]
    hparams.update(facts)
    torch.save(saved, old)
    got, expected = _predict_test_split(cli, old, tmp_path, "old")
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    assert EncodingParams.of_model(5, None) == EncodingParams(max_hops=5)

"""Fine-tuning through the installed commands on real data: a tiny model pretrained on ZINC-12k
starts an ESOL run (``--model.init_from``), which then tests, predicts and resumes like any run;
checkpoints that do not fit are refused naming every misfit; the warmup follows the schedule;
a sparse-label CSV trains through batches without any label."""
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
import torch

from graphormer_urpe.data.facts import DataFacts
from graphormer_urpe.cli.fit import main as cli_main
from graphormer_urpe.nn.graphormer import GraphormerConfig
from graphormer_urpe.training.module import GraphormerModule

REPO = Path(__file__).resolve().parents[2]
ESOL_TARGET = "measured log solubility in mols per litre"
BIN = Path(sys.executable).parent
TINY = {"num_layers": 2, "hidden_dim": 16, "ffn_dim": 16, "num_heads": 2, "dropout": 0.0,
        "attention_dropout": 0.0, "activation_dropout": 0.0}
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]


def run(command: str, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([str(BIN / command), *map(str, args)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    if ok:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


def esol_args(run_dir: Path, esol: Path, *extra: str) -> list[str]:
    return ["--config", "configs/esol.yaml", "--config", "configs/esol_finetune.yaml", *QUIET,
            "--trainer.default_root_dir", run_dir, "--model.backbone", json.dumps(TINY),
            "--data.init_args.path", esol, "--data.init_args.cache_root", run_dir.parent / "cache",
            "--trainer.limit_val_batches", "1", *extra]


def state(ckpt: Path) -> dict[str, torch.Tensor]:
    return torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]


@pytest.fixture(scope="module")
def pretrained(zinc_root, tmp_path_factory) -> Path:
    """A tiny URPE model fitted for 4 steps on ZINC-12k by ``graphormer-urpe fit``."""
    work = tmp_path_factory.mktemp("pretrain")
    (work / "data").mkdir()
    (work / "data" / "ZINC").symlink_to(zinc_root, target_is_directory=True)
    run("graphormer-urpe", "fit", "--config", "configs/zinc.yaml", *QUIET,
        "--trainer.default_root_dir", work / "run", "--trainer.precision", "32-true",
        "--trainer.max_steps", "4", "--trainer.limit_val_batches", "1",
        "--model.backbone", json.dumps(TINY), "--model.warmup_steps", "1",
        "--data.init_args.root", work / "data", "--data.init_args.max_hops", "5")
    return work / "run" / "checkpoints" / "last.ckpt"


def test_fine_tune_loads_the_backbone_then_tests_predicts_and_resumes(pretrained, esol_csv, tmp_path, run_main,
                                                                     monkeypatch):
    """With the backbone frozen for every step, the fine-tuned backbone IS the pretrained one
    (bit for bit) while the head trained; the result is a normal checkpoint (tested and resumed
    by ``main()`` in this process, predicted by the installed command)."""
    source = tmp_path / "pretrained.ckpt"
    source.write_bytes(pretrained.read_bytes())
    run_dir = tmp_path / "ft"
    fit = run("graphormer-urpe", "fit", *esol_args(run_dir, esol_csv, "--model.init_from", source,
                                                   "--model.freeze_backbone_steps", "3",
                                                   "--model.head_lr", "3e-3", "--trainer.max_steps", "3"))
    assert f"init_from {source}: loaded" in fit.stderr and "output head re-initialised (reinit_head" in fit.stderr
    last = run_dir / "checkpoints" / "last.ckpt"
    before, after = state(pretrained), state(last)
    backbone = [n for n in after if not n.startswith("model.head.")]
    assert len(backbone) > 20
    for name in backbone:
        torch.testing.assert_close(after[name], before[name], rtol=0, atol=0, msg=name)
    assert not torch.equal(after["model.head.weight"], before["model.head.weight"])
    hparams = torch.load(last, map_location="cpu", weights_only=True)["hyper_parameters"]
    assert (hparams["facts"]["featurizer"], hparams["init_from"]) == ("zinc", str(source))

    source.unlink()  # a fine-tuned checkpoint needs its source no more: test, predict, resume
    monkeypatch.chdir(REPO)
    done = run_main(cli_main, ["test", *esol_args(run_dir, esol_csv, "--ckpt_path", last)])
    assert done.returncode == 0 and "test/mae" in done.stdout, done.stderr[-3000:]
    molecules = tmp_path / "mols.csv"
    pd.read_csv(esol_csv).head(20).to_csv(molecules, index=False)
    run("graphormer-urpe-predict", "--ckpt", last, "--input", molecules, "--output", tmp_path / "p.csv")
    with open(tmp_path / "p.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 20 and all(np.isfinite(float(r[f"prediction_{ESOL_TARGET}"])) for r in rows)
    done = run_main(cli_main, ["fit", *esol_args(run_dir, esol_csv, "--model.init_from", source,
                                                 "--trainer.max_steps", "5", "--ckpt_path", last)])
    assert done.returncode == 0, done.stderr[-3000:]
    assert torch.load(last, map_location="cpu", weights_only=True)["global_step"] == 5


def test_frozen_layers_stay_as_loaded_through_a_fit_and_its_resume(pretrained, esol_csv, tmp_path, run_main,
                                                                    monkeypatch):
    """``--model.freeze_layers 1`` of 2: the input encoders, the attention biases and layer 0
    are the pretrained tensors bit for bit after the steps (and after a resumed fit's), while
    layer 1, the final norm and the head trained."""
    monkeypatch.chdir(REPO)
    run_dir = tmp_path / "ft"
    fit_args = esol_args(run_dir, esol_csv, "--model.init_from", pretrained, "--model.freeze_layers", "1",
                         "--model.freeze_backbone_steps", "0", "--model.warmup_fraction", "0.0")
    done = run_main(cli_main, ["fit", *fit_args, "--trainer.max_steps", "3"])
    assert done.returncode == 0, done.stderr[-3000:]
    last = run_dir / "checkpoints" / "last.ckpt"
    done = run_main(cli_main, ["fit", *fit_args, "--trainer.max_steps", "5", "--ckpt_path", last])
    assert done.returncode == 0, done.stderr[-3000:]
    before, after = state(pretrained), state(last)
    trained = ("model.layers.1.", "model.urpe_scales.1.", "model.final_norm.", "model.head.")
    frozen = [n for n in after if not n.startswith(trained)]
    assert {n.split(".")[1] for n in frozen} >= {"atom_encoder", "degree_encoder", "graph_token", "spatial_bias",
                                                "edge_bias", "virtual_distance", "layers", "urpe_scales"}
    for name in frozen:
        torch.testing.assert_close(after[name], before[name], rtol=0, atol=0, msg=name)
    for name in ("model.layers.1.ffn.0.weight", "model.final_norm.weight"):
        assert not torch.equal(after[name], before[name]), name


def test_freeze_layers_out_of_range_is_one_line(pretrained, esol_csv, tmp_path):
    run_dir = tmp_path / "ft"
    done = run("graphormer-urpe", "fit", *esol_args(run_dir, esol_csv, "--model.init_from", pretrained,
                                                    "--trainer.max_steps", "1", "--model.freeze_layers", "3"), ok=False)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "graphormer-urpe: error: model.freeze_layers 3: give 0 to 2, the backbone's number of layers" in done.stderr
    assert not (run_dir / "checkpoints").exists()


def test_from_scratch_every_layer_trains_whatever_freeze_layers_says():
    """``configs/csv.yaml`` freezes layers of the backbone it loads; ``--model.init_from null``
    (the same recipe from scratch) has none loaded, so nothing is frozen."""
    facts = DataFacts(num_atom_embeddings=29, num_bond_embeddings=5, max_hops=5)
    frozen = {}
    for init_from in (None, "pretrained:zinc-descriptors"):
        module = GraphormerModule(facts, backbone=GraphormerConfig(**TINY), freeze_layers=1, init_from=init_from)
        module.on_train_batch_start(None, 0)
        frozen[init_from] = {n.split(".")[0] for n, p in module.model.named_parameters() if not p.requires_grad}
    assert frozen[None] == set()
    assert {"atom_encoder", "spatial_bias", "layers", "urpe_scales"} <= frozen["pretrained:zinc-descriptors"]


def test_fine_tune_keeps_a_fitting_head_unless_told(pretrained, esol_csv, tmp_path, run_main, caplog, monkeypatch):
    """Same task and width: the head is the checkpoint's too (before the first step)."""
    monkeypatch.chdir(REPO)
    module_args = esol_args(tmp_path / "ft", esol_csv, "--model.init_from", pretrained, "--model.reinit_head",
                            "false", "--trainer.max_steps", "1", "--model.freeze_backbone_steps", "0")
    with caplog.at_level("INFO", logger="graphormer_urpe"):
        done = run_main(cli_main, ["fit", *module_args])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "output head loaded too" in caplog.text


@pytest.mark.parametrize("override, expected", [
    (["--model.backbone.num_layers", "3"],
     ["tensor(s) of", "layers.2.attn.in_proj.weight: model [48, 16], not in the checkpoint", "nothing was loaded"]),
    (["--model.backbone.hidden_dim", "8", "--model.backbone.ffn_dim", "8"],
     ["atom_encoder.embedding.weight: checkpoint [29, 16], model [29, 8]"]),
    (["--data.init_args.featurizer", "ogb"],
     ["was trained on the 'zinc' featurizer but the data uses 'ogb'", "data.init_args.featurizer zinc"]),
])
def test_a_checkpoint_that_does_not_fit_is_refused_naming_each_misfit(pretrained, esol_csv, tmp_path, run_main,
                                                                      monkeypatch, override, expected):
    monkeypatch.chdir(REPO)
    run_dir = tmp_path / "ft"
    done = run_main(cli_main, ["fit", *esol_args(run_dir, esol_csv, "--model.init_from", pretrained,
                                                 "--trainer.max_steps", "1"), *override])
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    for text in expected:
        assert text in done.stderr
    assert not (run_dir / "checkpoints").exists()


def test_a_sequence_model_is_refused_as_no_graphormer_checkpoint(esol_csv, tmp_path, run_main, monkeypatch):
    """A checkpoint of graphormer-urpe-synthetic (a sequence Transformer) records no featurizer:
    it is named for what it is, not blamed on the featurizer."""
    from graphormer_urpe.nn.sequence import SequenceTransformer

    model = SequenceTransformer(vocab_size=10, num_classes=10, max_len=8, embed_dim=16, num_heads=2,
                                num_layers=1, ffn_dim=16)
    torch.save({"state_dict": model.state_dict(), "task": "pi", "vocab_size": 10}, tmp_path / "cell.pt")
    monkeypatch.chdir(REPO)
    done = run_main(cli_main, ["fit", *esol_args(tmp_path / "ft", esol_csv, "--model.init_from",
                                                 tmp_path / "cell.pt", "--trainer.max_steps", "1")])
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "featurizer" not in done.stderr
    assert f"graphormer-urpe: error: model.init_from: {tmp_path / 'cell.pt'} is not a Graphormer checkpoint: " \
           "it has no atom embedding atom_encoder.embedding.weight" in done.stderr


def test_missing_init_from_is_one_clear_line(esol_csv, tmp_path, run_main, monkeypatch):
    monkeypatch.chdir(REPO)
    done = run_main(cli_main, ["fit", *esol_args(tmp_path / "ft", esol_csv, "--model.init_from",
                                                 tmp_path / "nope.ckpt", "--trainer.max_steps", "1")])
    assert done.returncode == 2
    assert f"model.init_from: checkpoint {tmp_path / 'nope.ckpt'} does not exist" in done.stderr


def test_esol_recipe_runs_for_two_epochs_with_its_warmup_fraction(esol_csv, tmp_path, run_main, monkeypatch):
    """configs/esol.yaml warms up over 6% of the schedule, so a 2-epoch run needs no override."""
    monkeypatch.chdir(REPO)
    run_dir = tmp_path / "esol"
    done = run_main(cli_main, ["fit", "--config", "configs/esol.yaml", *QUIET, "--trainer.max_epochs", "2",
                               "--trainer.default_root_dir", run_dir, "--model.backbone", json.dumps(TINY),
                               "--data.init_args.cache_root", tmp_path / "cache", "--trainer.limit_val_batches", "1",
                               "--trainer.log_every_n_steps", "1"])
    assert done.returncode == 0, done.stderr[-3000:]
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert checkpoint["global_step"] == 2 * 29  # 902 scaffold-split training molecules, batch 32
    metrics = pd.read_csv(next((run_dir / "csv").rglob("metrics.csv")))
    lr = metrics.dropna(subset=["lr-AdamW/weight"]).set_index("step")["lr-AdamW/weight"]
    # warmup: 6% of 58 steps, then the decay; the update at step s is number s + 1, so the
    # peak is the warmup's last update
    assert lr.idxmax() == round(0.06 * 58) - 1
    assert lr.max() == pytest.approx(2e-4) and lr.iloc[-1] < lr.max() / 10


def test_warmup_fraction_replaces_warmup_steps_in_the_schedule_checks():
    """With a fraction, the warmup the checks see is the fraction's, not warmup_steps' default."""
    # warmup_steps' default 60,000 > 30 is unused
    GraphormerModule(DataFacts(num_atom_embeddings=29, num_bond_embeddings=5), warmup_fraction=0.1,
                     total_steps=30, backbone=TINY)
    with pytest.raises(ValueError, match=r"model.warmup_fraction must be in \[0, 1\), got 1.5"):
        GraphormerModule(DataFacts(num_atom_embeddings=29, num_bond_embeddings=5), warmup_fraction=1.5,
                         total_steps=30, backbone=TINY)


def test_head_lr_gives_the_head_its_own_param_groups():
    module = GraphormerModule(DataFacts(num_atom_embeddings=29, num_bond_embeddings=5), lr=1e-3,
                              head_lr=5e-3, warmup_steps=1, total_steps=10, backbone=TINY)
    optimizer = module.configure_optimizers()["optimizer"]
    groups = {g["name"]: g for g in optimizer.param_groups}
    head = {id(p) for p in module.model.head.parameters()}
    assert {id(p) for n, g in groups.items() if n.startswith("head/") for p in g["params"]} == head
    assert all(g["initial_lr"] == (5e-3 if n.startswith("head/") else 1e-3) for n, g in groups.items())


def test_sparse_labels_batches_without_any_label_add_no_loss(esol_csv, tmp_path, run_main, monkeypatch):
    """ESOL with 95% of its targets blanked: many batches of 8 have no label; the run goes on."""
    table = pd.read_csv(esol_csv)
    rng = np.random.default_rng(0)
    table.loc[rng.random(len(table)) > 0.05, ESOL_TARGET] = np.nan
    path = tmp_path / "sparse.csv"
    table.to_csv(path, index=False)
    run_dir = tmp_path / "run"
    monkeypatch.chdir(REPO)
    done = run_main(cli_main, [
        "fit", "--config", "configs/esol.yaml", *QUIET, "--trainer.max_steps", "40",
        "--trainer.default_root_dir", run_dir, "--model.backbone", json.dumps(TINY),
        "--data.init_args.path", path, "--data.init_args.cache_root", tmp_path / "cache",
        "--data.init_args.batch_size", "8", "--trainer.log_every_n_steps", "1",
        "--trainer.limit_val_batches", "1"])
    assert done.returncode == 0, done.stderr[-3000:]
    losses = pd.read_csv(next((run_dir / "csv").rglob("metrics.csv")))["train/loss"].dropna()
    assert len(losses) == 40 and np.isfinite(losses).all()
    assert (losses == 0).sum() >= 5 and (losses > 0).sum() >= 5


def test_multiclass_checkpoint_predicts_class_probabilities(esol_csv, tmp_path):
    table = pd.read_csv(esol_csv).head(200)
    table["solubility_class"] = np.digitize(table[ESOL_TARGET], [-4.0, -2.0])  # 0, 1, 2
    path = tmp_path / "classes.csv"
    table[["smiles", "solubility_class"]].to_csv(path, index=False)
    run_dir = tmp_path / "run"
    run("graphormer-urpe", "fit", "--config", "configs/esol.yaml", *QUIET, "--trainer.max_steps", "2",
        "--trainer.default_root_dir", run_dir, "--model.backbone", json.dumps(TINY),
        "--data.init_args.path", path, "--data.init_args.target_columns", '["solubility_class"]',
        "--data.init_args.task", "multiclass", "--data.init_args.cache_root", tmp_path / "cache",
        "--trainer.limit_val_batches", "1")
    molecules = tmp_path / "mols.smi"
    molecules.write_text("CCO\nc1ccccc1\nC1CC\n")
    run("graphormer-urpe-predict", "--ckpt", run_dir / "checkpoints" / "last.ckpt", "--input", molecules,
        "--output", tmp_path / "p.csv")
    out = pd.read_csv(tmp_path / "p.csv")
    columns = [f"prediction_solubility_class_{k}" for k in range(3)]
    assert list(out.columns) == ["row", "smiles", *columns, "error"]
    np.testing.assert_allclose(out.loc[:1, columns].sum(axis=1), 1.0, rtol=1e-5)
    assert out.loc[2, columns].isna().all() and "RDKit cannot parse" in out.loc[2, "error"]

"""PredictionModel: a GraphormerModule's predictions from its checkpoint, without Lightning."""
from __future__ import annotations

import gzip
import inspect
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from graphormer_urpe.prediction.model import predict_smiles
from graphormer_urpe.data.facts import DataFacts
from graphormer_urpe.prediction.model import PredictionModel, module_arguments
from graphormer_urpe.training.module import GraphormerModule
from graphormer_urpe.prediction.table import InputRow

TINY = {"num_layers": 2, "hidden_dim": 16, "ffn_dim": 16, "num_heads": 2}


def test_the_hyperparameters_prediction_accepts_are_the_modules_arguments():
    """graphormer-urpe-predict accepts the hyperparameters LightningCLI's --ckpt_path does: the
    names of GraphormerModule's arguments, read from its source without importing Lightning."""
    module_args = set(inspect.signature(GraphormerModule).parameters)
    assert module_arguments() == module_args
    assert set(inspect.signature(PredictionModel).parameters) - {"training"} <= module_args


def test_a_checkpoint_with_the_facts_as_separate_hyperparameters_still_loads(zinc_source, tmp_path):
    """Checkpoints written before the facts were one object record each fact as a
    hyperparameter of its own (and options since retired, ``cuda_graphs``): the installed command
    predicts from them as from a new one."""
    torch.manual_seed(0)
    module = GraphormerModule(DataFacts(num_atom_embeddings=29, num_bond_embeddings=5, num_targets=2),
                              backbone=TINY)
    flat = {k: v for k, v in module.hparams.items() if k != "facts"} | module.hparams["facts"]
    assert DataFacts.nest(flat) == dict(module.hparams) and DataFacts.of_hparams(flat) == module.facts
    # The oldest record no max_hops: they were trained with 5, whatever today's default.
    assert DataFacts.of_hparams({k: v for k, v in flat.items() if k != "max_hops"}).max_hops == 5
    flat["cuda_graphs"] = False
    with gzip.open(zinc_source / "jtvae_test.smi.gz", "rt") as handle:
        (tmp_path / "in.smi").write_text("".join(line for _, line in zip(range(20), handle)))
    outputs = []
    for name, hparams in (("new", dict(module.hparams)), ("flat", flat)):
        torch.save({"state_dict": module.state_dict(), "hyper_parameters": hparams}, tmp_path / f"{name}.ckpt")
        done = subprocess.run([str(Path(sys.executable).with_name("graphormer-urpe-predict")),
                               "--ckpt", str(tmp_path / f"{name}.ckpt"), "--input", str(tmp_path / "in.smi"),
                               "--output", str(tmp_path / f"{name}.csv"), "--quiet"],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        outputs.append((tmp_path / f"{name}.csv").read_text())
    assert outputs[0] == outputs[1] and len(outputs[0].splitlines()) == 21


@pytest.mark.parametrize("task, num_targets", [("regression", 2), ("classification", 3), ("multiclass", 4)])
def test_same_predictions_as_the_lightning_module_on_zinc(zinc_source, task, num_targets):
    torch.manual_seed(0)
    module = GraphormerModule(DataFacts(num_atom_embeddings=29, num_bond_embeddings=5,
                                        num_targets=num_targets, task=task), backbone=TINY).eval()
    with torch.no_grad():
        for scale in module.model.urpe_scales:
            scale.delta.uniform_(-0.5, 0.5)
    inference = PredictionModel(**dict(module.hparams)).eval()
    inference.load_state_dict(module.state_dict())  # strict: the checkpoint's keys as they are
    assert dict(inference.hparams) == dict(module.hparams)
    with gzip.open(zinc_source / "jtvae_test.smi.gz", "rt") as handle:
        smiles = [line.strip() for _, line in zip(range(200), handle)]
    expected = predict_smiles(module, [InputRow(s) for s in smiles])
    got = predict_smiles(inference, [InputRow(s) for s in smiles])
    assert np.isfinite(expected).all() and expected.shape == (200, num_targets)
    np.testing.assert_array_equal(got, expected)


def test_unknown_hyperparameter_is_refused():
    with pytest.raises(TypeError, match="unexpected hyperparameters"):
        PredictionModel(facts={"num_atom_embeddings": 29, "num_bond_embeddings": 5}, backbone=TINY,
                       learning_rate=1.0)


def test_predict_command_does_not_import_lightning(zinc_source, tmp_path):
    torch.manual_seed(0)
    module = GraphormerModule(DataFacts(num_atom_embeddings=29, num_bond_embeddings=5), backbone=TINY)
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)},
               tmp_path / "m.ckpt")
    with gzip.open(zinc_source / "jtvae_test.smi.gz", "rt") as handle:
        (tmp_path / "in.smi").write_text("".join(line for _, line in zip(range(20), handle)))
    script = ("import sys; from graphormer_urpe.cli.predict import main; "
              f"code = main(['--ckpt', {str(tmp_path / 'm.ckpt')!r}, '--input', {str(tmp_path / 'in.smi')!r}, "
              f"'--output', {str(tmp_path / 'out.csv')!r}, '--quiet']); "
              "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'torchmetrics'))); "
              "sys.exit(code)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    assert len((tmp_path / "out.csv").read_text().splitlines()) == 21


def test_a_datamodules_facts_build_the_module_the_cli_links(tmp_path):
    from graphormer_urpe.data import ZINCDataModule

    facts = DataFacts.of(ZINCDataModule(root=str(tmp_path), rwse_steps=4))
    assert facts == DataFacts(num_atom_embeddings=29, num_bond_embeddings=5, node_encodings={"rwse": 4})
    module = GraphormerModule(facts, backbone=TINY)
    assert module.facts == facts and module.hparams["facts"] == facts.as_dict()
    assert list(module.model.node_encoders) == ["rwse"]

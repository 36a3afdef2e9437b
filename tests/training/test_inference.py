"""InferenceModel: a GraphormerModule's predictions from its checkpoint, without Lightning."""
from __future__ import annotations

import dataclasses
import gzip
import inspect
import subprocess
import sys

import numpy as np
import pytest
import torch

from graphormer_urpe.training.inference import predict_smiles
from graphormer_urpe.training.predictions import InputRow
from graphormer_urpe.training.inference import TRAINING_HPARAMS, InferenceModel
from graphormer_urpe.training.module import GraphormerModule
from graphormer_urpe.data.facts import DataFacts

TINY = {"num_layers": 2, "hidden_dim": 16, "ffn_dim": 16, "num_heads": 2}


def test_training_hyperparameters_are_the_modules_other_arguments():
    module_args = set(inspect.signature(GraphormerModule).parameters)
    inference_args = (set(inspect.signature(InferenceModel).parameters) - {"hparams"}) | set(DataFacts.names())
    assert TRAINING_HPARAMS == module_args - inference_args
    assert inference_args <= module_args


def test_the_modules_data_fact_arguments_default_to_the_facts_defaults():
    """``GraphormerModule`` spells out the facts as init arguments (the CLI links each); their
    defaults are DataFacts' own, so a module built without one is the model DataFacts describes."""
    params = inspect.signature(GraphormerModule).parameters
    for field in dataclasses.fields(DataFacts):
        expected = inspect.Parameter.empty if field.default is dataclasses.MISSING else field.default
        assert params[field.name].default == expected, field.name


@pytest.mark.parametrize("task, num_targets", [("regression", 2), ("classification", 3), ("multiclass", 4)])
def test_same_predictions_as_the_lightning_module_on_zinc(zinc_source, task, num_targets):
    torch.manual_seed(0)
    module = GraphormerModule(num_atom_embeddings=29, num_bond_embeddings=5, num_targets=num_targets,
                              task=task, backbone=TINY).eval()
    with torch.no_grad():
        for scale in module.model.urpe_scales:
            scale.delta.uniform_(-0.5, 0.5)
    inference = InferenceModel(**dict(module.hparams)).eval()
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
        InferenceModel(num_atom_embeddings=29, num_bond_embeddings=5, backbone=TINY, learning_rate=1.0)


def test_predict_command_does_not_import_lightning(zinc_source, tmp_path):
    torch.manual_seed(0)
    module = GraphormerModule(num_atom_embeddings=29, num_bond_embeddings=5, backbone=TINY)
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)},
               tmp_path / "m.ckpt")
    with gzip.open(zinc_source / "jtvae_test.smi.gz", "rt") as handle:
        (tmp_path / "in.smi").write_text("".join(line for _, line in zip(range(20), handle)))
    script = ("import sys; from graphormer_urpe.predict import main; "
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
    assert set(DataFacts.names()) <= set(inspect.signature(GraphormerModule).parameters)
    module = GraphormerModule(**facts.as_dict(), backbone=TINY)
    assert {name: module.hparams[name] for name in DataFacts.names()} == facts.as_dict()
    assert list(module.model.node_encoders) == ["rwse"]

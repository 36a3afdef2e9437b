"""The compiled path's options end to end on CPU (the same code runs on a GPU): device-resident data
through the training CLI, and ``GraphormerModule(compile=True)``."""
from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from graphormer_urpe.data import ZINCDataModule
from graphormer_urpe.data.resident import ResidentLoader
from graphormer_urpe.training.lightning_cli import build_cli
from graphormer_urpe.data.facts import DataFacts
from graphormer_urpe.training.module import GraphormerModule

REPO = Path(__file__).resolve().parents[2]
#: No dropout, so two runs over the same batches reach the same weights.
TINY_BACKBONE = {"attention": "urpe", "num_layers": 2, "hidden_dim": 16, "ffn_dim": 16, "num_heads": 2,
                 "dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def fit(run_dir: Path, data_root: Path, max_steps: int, *extra: str):
    """A few steps of configs/zinc.yaml with a tiny backbone; epochs of 3 batches."""
    return build_cli(["fit",
                      "--config", str(REPO / "configs" / "zinc.yaml"),
                      "--trainer.default_root_dir", str(run_dir),
                      "--trainer.check_val_every_n_epoch", "1",  # the recipe: every 10 epochs
                      "--data.init_args.max_hops", "5",
                      "--trainer.max_steps", str(max_steps),
                      "--trainer.precision", "32-true",
                      "--trainer.limit_train_batches", "3",
                      "--trainer.limit_val_batches", "2",
                      "--trainer.enable_progress_bar", "false",
                      "--trainer.enable_model_summary", "false",
                      "--model.backbone", json.dumps(TINY_BACKBONE),
                      "--model.warmup_steps", "4",
                      "--model.total_steps", "20",
                      "--data.init_args.root", str(data_root),
                      "--data.init_args.batch_size", "16",
                      *extra])


def test_resident_training_resumes_and_equals_dataloader_training(zinc_data_root, tmp_path):
    """4 resident steps (last.ckpt is written at the end of epoch 0, step 3), resumed from
    last.ckpt to 7 (two epoch starts, each drawing its order from (seed, epoch)), give the weights
    of 7 uninterrupted DataLoader steps: the same batches in the same order."""
    resident = ("--data.init_args.device_resident", "true")
    first = fit(tmp_path / "resident", zinc_data_root, 4, *resident)
    assert isinstance(first.trainer.train_dataloader, ResidentLoader)
    resumed = fit(tmp_path / "resident", zinc_data_root, 7, *resident, "--ckpt_path", "last")
    straight = fit(tmp_path / "loader", zinc_data_root, 7)
    assert resumed.trainer.global_step == straight.trainer.global_step == 7
    assert resumed.trainer.current_epoch == straight.trainer.current_epoch
    reference = straight.model.state_dict()
    for name, value in resumed.model.state_dict().items():
        torch.testing.assert_close(value, reference[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert "val/mae" in resumed.trainer.callback_metrics


@pytest.mark.slow
def test_compiled_backbone_matches_eager(zinc_data_root):
    """compile=True: same parameter names (checkpoints interchange), and the same outputs and
    gradients as eager on real ZINC batches of different sizes without recompiling per size."""
    from torch._dynamo.utils import counters

    dm = ZINCDataModule(root=str(zinc_data_root), eval_batch_size=24)
    dm.setup("validate")
    batches = [batch for _, batch in zip(range(2), dm.val_dataloader())]
    assert batches[0].x.shape[1] != batches[1].x.shape[1]
    arguments = {"facts": DataFacts(num_atom_embeddings=dm.num_atom_embeddings,
                                    num_bond_embeddings=dm.num_bond_embeddings),
                 "backbone": {**TINY_BACKBONE, "num_layers": 2}}
    torch.manual_seed(0)
    eager = GraphormerModule(**arguments)
    compiled = GraphormerModule(**arguments, compile=True)
    assert compiled.state_dict().keys() == eager.state_dict().keys()
    compiled.load_state_dict(eager.state_dict())
    torch._dynamo.reset()
    counters.clear()
    # (config.patch, not monkeypatch: undoing a monkeypatch deletes a dynamo config entry)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for batch in batches:
            try:
                output = compiled(batch)
            except torch._dynamo.exc.BackendCompilerFailed as error:  # e.g. no C++ compiler for inductor
                pytest.skip(f"torch.compile (inductor) cannot compile on this machine: {error}")
            expected = eager(batch)
            torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-6)
            output.sum().backward()
            expected.sum().backward()
    # one graph for the (shared) layer code, one for the edge-path encoding
    assert counters["stats"]["unique_graphs"] == 2
    gradients = dict(eager.named_parameters())
    for name, parameter in compiled.named_parameters():
        torch.testing.assert_close(parameter.grad, gradients[name].grad, rtol=1e-4, atol=1e-6,
                                   msg=lambda m: f"{name}: {m}")


def test_the_engine_trains_a_compiled_backbone_as_it_trains_the_eager_one(zinc_data_root, tmp_path, monkeypatch):
    """``configs/engine.yaml`` then ``--model.compile true`` through the CLI: the compiled layers
    and edge encoding run inside the engine's step (on a GPU, inside its CUDA graph), and 6 steps
    on real ZINC batches of one shape end at the uncompiled engine's parameters, within float32
    rounding. Compiled by ``aot_eager`` (dynamo and AOTAutograd; inductor's code for these
    regions is checked against eager above)."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    engine = ("--config", str(REPO / "configs" / "engine.yaml"), "--trainer.precision", "32-true")
    runs = {}
    counters.clear()
    for compiled in (False, True):
        runs[compiled] = fit(tmp_path / str(compiled), zinc_data_root, 6, *engine,
                             "--model.compile", str(compiled).lower())
    assert counters["stats"]["unique_graphs"] >= 2 and not counters["graph_break"]
    for cli in runs.values():
        assert cli.trainer.global_step == 6 and cli.model._engine.spec.static_shapes is not None
    assert runs[True].model.model.layers[0]._compiled_call_impl is not None  # compiled regions
    assert runs[False].model.model.layers[0]._compiled_call_impl is None
    expected = dict(runs[False].model.named_parameters())
    for name, parameter in runs[True].model.named_parameters():
        torch.testing.assert_close(parameter, expected[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")

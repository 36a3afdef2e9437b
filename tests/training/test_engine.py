"""The training engine (``GraphormerModule(engine=True)``) on CPU, real ZINC, a tiny model: the
same training as Lightning's eager step, exact mid-epoch resume through the CLI, non-finite
steps skipped on the device and reported; on a GPU, the captured step equals the eager one and
syncs nowhere."""
from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from graphormer_urpe.data.datamodule import ZINCDataModule
from graphormer_urpe.training.cli import build_cli
from graphormer_urpe.training.module import GraphormerModule

REPO = Path(__file__).resolve().parents[2]
TINY = {"attention": "urpe", "num_layers": 2, "hidden_dim": 16, "ffn_dim": 16, "num_heads": 2}
NO_DROPOUT = {"dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Record(pl.Callback):
    """Each step's loss, and parameters / optimizer state around chosen steps."""

    def __init__(self, inject_at: int | None = None) -> None:
        self.losses, self.inject_at, self.around = [], inject_at, {}

    def snapshot(self, trainer, module):
        state = trainer.optimizers[0].state_dict()["state"]
        return ({n: p.detach().clone() for n, p in module.named_parameters()},
                {k: {n: v.clone() for n, v in s.items()} for k, s in state.items()})

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == self.inject_at:  # an infinite target: a non-finite loss
            self.y = trainer.train_dataloader.split.y.clone()
            trainer.train_dataloader.split.y.fill_(float("inf"))
            self.around["before"] = self.snapshot(trainer, module)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        if trainer.global_step == self.inject_at + 1 if self.inject_at is not None else False:
            trainer.train_dataloader.split.y.copy_(self.y)
            self.around["after"] = self.snapshot(trainer, module)


def train(root: Path, engine: bool, steps: int, backbone: dict, callbacks=(), **trainer_args):
    dm = ZINCDataModule(root=str(root), batch_size=16, device_resident=True, static_shapes=True)
    pl.seed_everything(3, verbose=False)
    module = GraphormerModule(num_atom_embeddings=dm.num_atom_embeddings,
                              num_bond_embeddings=dm.num_bond_embeddings, backbone=backbone,
                              lr=1e-3, warmup_steps=5, total_steps=40, engine=engine)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, precision="32-true",
                         gradient_clip_val=0.05, limit_val_batches=0, num_sanity_val_steps=0,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=list(callbacks), **trainer_args)
    trainer.fit(module, datamodule=dm)
    return module, trainer


def test_engine_step_equals_the_eager_lightning_step(zinc_data_root):
    """24 steps with dropout and clipping active: the same batches, dropout masks, losses,
    parameters and AdamW moments as Lightning's eager step (within float32 rounding: the engine's
    AdamW is the fused kernel, the eager one on CPU the per-tensor loop)."""
    runs = {}
    for engine in (False, True):
        record = Record()
        module, trainer = train(zinc_data_root, engine, 24, TINY, [record])
        runs[engine] = (module, trainer, record)
    (eager, eager_trainer, eager_record), (fast, fast_trainer, fast_record) = runs[False], runs[True]
    assert fast_trainer.global_step == eager_trainer.global_step == 24
    torch.testing.assert_close(torch.tensor(fast_record.losses), torch.tensor(eager_record.losses),
                               rtol=1e-4, atol=1e-5)
    assert len(set(fast_record.losses)) == 24
    reference = dict(eager.named_parameters())
    for name, param in fast.named_parameters():
        torch.testing.assert_close(param, reference[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    fast_state, eager_state = (t.optimizers[0].state_dict() for t in (fast_trainer, eager_trainer))
    for key, state in eager_state["state"].items():
        for field in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(fast_state["state"][key][field], state[field], rtol=1e-4, atol=1e-9)
    # the host schedule (what checkpoints and the learning-rate monitor record) agrees
    assert [g["lr"] for g in fast_state["param_groups"]] == [g["lr"] for g in eager_state["param_groups"]]


def test_a_non_finite_step_is_skipped_and_reported(zinc_data_root, caplog):
    """Step 6 sees infinite targets: its update is skipped on the device (parameters, moments
    and the step count unchanged), counted and reported at the next logging interval."""
    record = Record(inject_at=6)
    with caplog.at_level("WARNING", logger="graphormer_urpe"):
        module, trainer = train(zinc_data_root, True, 12, TINY, [record], log_every_n_steps=4)
    (params_before, state_before), (params_after, state_after) = record.around["before"], record.around["after"]
    for name, value in params_before.items():
        assert torch.equal(params_after[name], value), name
    for key, state in state_before.items():
        for field, value in state.items():
            assert torch.equal(state_after[key][field], value), (key, field)
    assert record.losses[6] == float("inf")
    assert all(torch.isfinite(torch.tensor(record.losses[:6] + record.losses[7:])))
    assert module._engine.total_skipped == 1
    assert "engine: skipped 1 of the last 4 steps" in caplog.text
    assert trainer.logged_metrics["train/skipped_steps"] == 1
    assert all(torch.isfinite(p).all() for p in module.parameters())

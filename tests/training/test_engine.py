"""The one training step (:mod:`graphormer_urpe.training.engine`) on CPU, real ZINC, a tiny model:
the same training as Lightning's own automatic-optimization step, exact mid-epoch resume through
the CLI, a checkpoint of the previous release's eager step resumed, the settings it does not do
refused in one line, non-finite steps skipped on the device and reported; on a GPU, the captured
step equals the eager one and syncs nowhere."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from graphormer_urpe.data import ZINCDataModule
from graphormer_urpe.data.resident import OrderSlice
from graphormer_urpe.training.lightning_cli import build_cli
from graphormer_urpe.data.facts import DataFacts
from graphormer_urpe.training.module import GraphormerModule

REPO = Path(__file__).resolve().parents[2]
TINY = {"attention": "urpe", "num_layers": 2, "hidden_dim": 16, "ffn_dim": 16, "num_heads": 2}
NO_DROPOUT = {"dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Record(pl.Callback):
    """Each step's loss; with ``inject`` (a range of steps), infinite targets in those steps
    (so a non-finite loss) and the parameters and optimizer state around them."""

    def __init__(self, inject: range = range(0)) -> None:
        self.losses, self.inject, self.around = [], inject, {}

    def snapshot(self, trainer, module):
        state = trainer.optimizers[0].state_dict()["state"]
        return ({n: p.detach().clone() for n, p in module.named_parameters()},
                {k: {n: v.clone() for n, v in s.items()} for k, s in state.items()})

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if self.inject and trainer.global_step == self.inject.start:
            self.y = trainer.train_dataloader.split.y.clone()
            trainer.train_dataloader.split.y.fill_(float("inf"))
            self.around["before"] = self.snapshot(trainer, module)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        if self.inject and trainer.global_step == self.inject.stop:
            trainer.train_dataloader.split.y.copy_(self.y)
            self.around["after"] = self.snapshot(trainer, module)


class LightningStep(GraphormerModule):
    """The reference: the same module trained by Lightning's own step (its automatic
    optimization: ``training_step`` returns the loss, Lightning runs backward, clipping and the
    optimizer), as the textbook LightningModule does."""

    def training_step(self, batch, batch_idx):
        if isinstance(batch, OrderSlice):  # a fit's batches of one shape: gathered as the step does
            items = batch.order[batch.start:batch.start + batch.size]
            batch = self.trainer.train_dataloader.split.batch(items.cpu().numpy(), items)
        return self._loss(self.model(batch), batch.y)

    optimizer_step = pl.LightningModule.optimizer_step
    optimizer_zero_grad = pl.LightningModule.optimizer_zero_grad
    backward = pl.LightningModule.backward

    def configure_callbacks(self):
        return []

    def on_save_checkpoint(self, checkpoint):
        pass


def train(root: Path, engine: bool, steps: int, backbone: dict, callbacks=(), module_args=None, data_args=None,
          accelerator: str = "cpu", **trainer_args):
    """``steps`` steps of the tiny model; ``engine`` False: :class:`LightningStep`."""
    trainer_args = {"logger": False, "enable_checkpointing": False, **trainer_args}
    dm = ZINCDataModule(root=str(root), batch_size=16,
                        **(data_args or {"device_resident": True, "static_shapes": True}))
    pl.seed_everything(3, verbose=False)
    module = (GraphormerModule if engine else LightningStep)(
        DataFacts(num_atom_embeddings=dm.num_atom_embeddings, num_bond_embeddings=dm.num_bond_embeddings),
        backbone=backbone, lr=1e-3, warmup_steps=5, total_steps=40, **(module_args or {}))
    trainer = pl.Trainer(accelerator=accelerator, devices=1, max_steps=steps, precision="32-true",
                         gradient_clip_val=0.05, limit_val_batches=0, num_sanity_val_steps=0,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks),
                         **trainer_args)
    trainer.fit(module, datamodule=dm)
    return module, trainer


def assert_same_training(actual, expected, exact: bool) -> None:
    """Losses, parameters and AdamW state of two ``(module, trainer, record)`` runs: bit for bit,
    or within float32 rounding."""
    (module, trainer, record), (ref_module, ref_trainer, ref_record) = actual, expected
    close = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-5, "atol": 1e-6}
    assert trainer.global_step == ref_trainer.global_step == 24
    torch.testing.assert_close(torch.tensor(record.losses), torch.tensor(ref_record.losses), **close)
    assert len(set(record.losses)) == 24
    reference = dict(ref_module.named_parameters())
    # A parameter follows its AdamW moments, which may differ by 1e-4 relative (below): the
    # virtual node's distance bias, whose gradient is a sum of cancelling terms, ended 1.3e-6
    # apart (of 0.018) on one CPU and within 2e-7 on another.
    param_close = close if exact else {"rtol": 1e-4, "atol": 1e-6}
    for name, param in module.named_parameters():
        torch.testing.assert_close(param, reference[name], **param_close, msg=lambda m: f"{name}: {m}")
    state, ref_state = (t.optimizers[0].state_dict() for t in (trainer, ref_trainer))
    for key, values in ref_state["state"].items():
        for field in ("exp_avg", "exp_avg_sq", "step"):
            # Moments within float32 rounding: a tiny gradient that is a sum of cancelling terms
            # can differ by a few 1e-9 between the two AdamW kernels' rounding.
            torch.testing.assert_close(state["state"][key][field], values[field],
                                       **({"rtol": 0, "atol": 0} if exact else {"rtol": 1e-4, "atol": 1e-8}))
    # the host schedule (what checkpoints and the learning-rate monitor record) agrees
    assert [g["lr"] for g in state["param_groups"]] == [g["lr"] for g in ref_state["param_groups"]]


@pytest.mark.parametrize("data_args", [None, {"bucket_batches": 4}], ids=["one shape", "DataLoader"])
def test_engine_step_equals_lightnings_own_step(zinc_data_root, data_args):
    """24 steps with dropout and clipping active: the same batches, dropout masks, losses,
    parameters and AdamW moments as Lightning's own step (both with the fused AdamW kernel), bit
    for bit. On batches of one shape the engine gathers them itself; on the DataLoader's batches
    of varying shapes it steps them as they come."""
    def run(engine: bool):
        record = Record()
        module, trainer = train(zinc_data_root, engine, 24, TINY, [record], data_args=data_args)
        return module, trainer, record

    engine = run(True)
    assert (engine[0]._engine.spec.static_shapes is not None) == (data_args is None)
    assert_same_training(engine, run(False), exact=True)


@pytest.mark.slow
def test_engine_on_the_fused_attention_kernels_under_the_cpu_interpreter(under_triton_interpreter):
    """The next test, where Triton's interpreter runs the fused kernels on a CPU."""
    under_triton_interpreter(__file__, "test_engine_step_on_the_fused_attention_kernels", passed=2)


@pytest.mark.parametrize("compile", [False, True], ids=["eager backbone", "compiled backbone"])
def test_engine_step_on_the_fused_attention_kernels(zinc_data_root, monkeypatch, fused_kernel_calls, compile):
    """``attention_impl="triton"`` in the training engine's step, with and without the compiled
    backbone around it (``aot_eager``: dynamo and AOTAutograd without inductor's C++ builds): every
    layer's attention runs on the fused kernels (counted) and the run trains as with the eager
    core (no dropout: the same arithmetic up to float32 rounding). On a GPU the engine records
    the step in a CUDA graph: the kernels are counted as the recording calls them."""
    import functools

    from graphormer_urpe.training.engine import CAPTURE_WARMUP_STEPS

    on_gpu, calls = torch.cuda.is_available(), fused_kernel_calls
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    runs = []
    for impl in ("eager", "triton"):
        record = Record()
        # graphs of at most 11 atoms: the interpreter runs every tile in numpy
        module, _ = train(zinc_data_root, True, 4, {**TINY, **NO_DROPOUT, "attention_impl": impl}, [record],
                          module_args={"compile": compile}, accelerator="cuda" if on_gpu else "cpu",
                          data_args={"device_resident": True, "static_shapes": True, "max_nodes": 11})
        runs.append((module, record))
        # a GPU calls them in the update-free steps before recording and in the recording only
        calls_per_layer = (CAPTURE_WARMUP_STEPS + 1) if on_gpu else 4
        assert len(calls) == (calls_per_layer * TINY["num_layers"] if impl == "triton" else 0)
    (eager, eager_record), (fused, fused_record) = runs
    torch.testing.assert_close(torch.tensor(fused_record.losses), torch.tensor(eager_record.losses),
                               rtol=1e-4, atol=1e-5)
    reference = dict(eager.named_parameters())
    for name, param in fused.named_parameters():
        torch.testing.assert_close(param, reference[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_engine_follows_head_lr_and_freeze_backbone_steps(zinc_data_root):
    """Fine-tuning options: the head's own peak learning rate (its param groups) and the first
    steps training the head alone give the engine Lightning's own step's training bit for bit: every group's learning rate follows the schedule from its own
    peak, and frozen parameters neither move nor decay until the phase ends."""
    options = {"head_lr": 5e-3, "freeze_backbone_steps": 7}

    def run(engine: bool):
        record = Record()
        module, trainer = train(zinc_data_root, engine, 24, TINY, [record], module_args=options)
        return module, trainer, record

    engine = run(True)
    assert_same_training(engine, run(False), exact=True)
    groups = engine[1].optimizers[0].param_groups
    assert {g["name"] for g in groups if g["initial_lr"] == 5e-3} == {"head/weight", "head/bias"}


def test_a_non_finite_step_is_skipped_and_reported(zinc_data_root, tmp_path, caplog):
    """Step 6 sees infinite targets: its update is skipped on the device (parameters, moments
    and the step count unchanged), counted and reported at the next logging interval, and the
    checkpoints hold the finite model."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    record = Record(inject=range(6, 7))
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1, save_last=True)
    with caplog.at_level("WARNING", logger="graphormer_urpe"):
        module, trainer = train(zinc_data_root, True, 12, TINY, [record, checkpoints], log_every_n_steps=4,
                                enable_checkpointing=True)
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
    assert trainer.callback_metrics["train/skipped_steps"] == 1
    saved = sorted((tmp_path / "ckpt").glob("*.ckpt"))
    assert len(saved) == 4  # steps 4, 8, 12 and last
    for path in saved:
        weights = torch.load(path, weights_only=True)["state_dict"]
        assert all(torch.isfinite(value).all() for value in weights.values() if value.is_floating_point())


def test_an_interval_of_only_non_finite_steps_stops_training(zinc_data_root, tmp_path):
    """Steps 4-7 all non-finite: training stops at the interval's report, and the checkpoint of
    step 4 (the last one) holds the model as it was before them."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    record = Record(inject=range(4, 8))
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_last=True)
    with pytest.raises(FloatingPointError, match="every training step of the last 4"):
        train(zinc_data_root, True, 12, TINY, [record, checkpoints], log_every_n_steps=4,
              enable_checkpointing=True)
    params_before, _ = record.around["before"]
    weights = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert weights["global_step"] == 4
    for name, value in params_before.items():
        assert torch.equal(weights["state_dict"][name], value), name


def fit(run_dir: Path, data_root: Path, max_steps: int, *extra: str):
    """configs/zinc.yaml + configs/engine.yaml with a tiny backbone, epochs of 8 batches of 16,
    validation and checkpoints after batch 5 of each epoch (as the previous release's checkpoint
    in tests/fixtures was trained, with its eager step)."""
    return build_cli(["fit",
                      "--config", str(REPO / "configs" / "zinc.yaml"),
                      "--config", str(REPO / "configs" / "engine.yaml"),
                      "--trainer.default_root_dir", str(run_dir),
                      "--trainer.max_steps", str(max_steps),
                      "--trainer.limit_train_batches", "8",
                      "--trainer.limit_val_batches", "2",
                      "--trainer.log_every_n_steps", "4",
                      "--trainer.enable_model_summary", "false",
                      "--trainer.val_check_interval", "5", "--trainer.check_val_every_n_epoch", "1",
                      "--model.backbone", json.dumps({**TINY, **NO_DROPOUT}),
                      "--model.warmup_steps", "4",
                      "--model.total_steps", "20",
                      "--data.init_args.root", str(data_root),
                      "--data.init_args.batch_size", "16",
                      *extra])


class Killed(Exception):
    pass


class KillAt(pl.Callback):
    """Stands in for a killed process: stops training with an error once ``step`` steps are
    done (an error saves no checkpoint, so last.ckpt stays the last periodic one)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            raise Killed(f"killed at step {self.step}")


def test_cli_engine_resumes_mid_epoch_exactly(zinc_data_root, tmp_path):
    """Through the CLI: killed after step 6, resumed from last.ckpt of step 5 (batch 5 of 8 of
    epoch 0, saved after its validation) to step 12 (past an epoch end), the run reaches the
    uninterrupted run's weights bit for bit; metrics are read from the device once per logging
    interval."""
    kill = json.dumps({"class_path": f"{__name__}.KillAt", "init_args": {"step": 6}})
    with pytest.raises(Killed):
        fit(tmp_path / "engine", zinc_data_root, 12, f"--trainer.callbacks+={kill}")
    checkpoint = torch.load(tmp_path / "engine" / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 5
    assert checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["completed"] == 5
    (tmp_path / "engine" / "checkpoints" / "last.ckpt").rename(tmp_path / "step5.ckpt")
    resumed = fit(tmp_path / "engine", zinc_data_root, 12, "--ckpt_path", str(tmp_path / "step5.ckpt"))
    straight = fit(tmp_path / "straight", zinc_data_root, 12)
    assert resumed.trainer.global_step == straight.trainer.global_step == 12
    assert resumed.trainer.current_epoch == straight.trainer.current_epoch
    reference = straight.model.state_dict()
    for name, value in resumed.model.state_dict().items():
        assert torch.equal(value, reference[name]), name

    metrics = (tmp_path / "straight" / "csv" / "version_0" / "metrics.csv").read_text().splitlines()
    header = metrics[0].split(",")
    logged = [dict(zip(header, row.split(","))) for row in metrics[1:]]
    steps = [int(row["step"]) for row in logged if row.get("train/loss")]
    assert steps == [3, 7, 11]  # log_every_n_steps 4
    assert all(float(row["train/skipped_steps"]) == 0 for row in logged if row.get("train/loss"))


def test_a_checkpoint_of_the_previous_releases_eager_step_resumes(zinc_data_root, tmp_path):
    """tests/fixtures/previous_release_eager_step5.ckpt: written by the previous release with
    Lightning's own step (unfused AdamW) from :func:`fit`'s recipe, 5 steps. It resumes: the
    restored optimizer takes the fused kernel, and training reaches the uninterrupted run's
    weights within float32 rounding (the first 5 steps used another AdamW kernel)."""
    saved = REPO / "tests" / "fixtures" / "previous_release_eager_step5.ckpt"
    checkpoint = torch.load(saved, weights_only=True)
    assert checkpoint["global_step"] == 5
    assert not any(group["fused"] for group in checkpoint["optimizer_states"][0]["param_groups"])
    resumed = fit(tmp_path / "old", zinc_data_root, 12, "--ckpt_path", str(saved))
    assert resumed.trainer.global_step == 12
    assert all(group["fused"] for group in resumed.trainer.optimizers[0].param_groups)
    straight = fit(tmp_path / "straight", zinc_data_root, 12)
    reference = straight.model.state_dict()
    for name, value in resumed.model.state_dict().items():
        torch.testing.assert_close(value, reference[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("option, value, needs", [
    ("--trainer.gradient_clip_algorithm", "value", "trainer.gradient_clip_algorithm norm (got value)"),
    ("--trainer.precision", "16-true", "trainer.precision 32-true, bf16-mixed or 16-mixed (got 16-true: the "
                                       "step keeps float32 weights and optimizer moments)"),
    ("--trainer.precision", "transformer-engine", "trainer.precision 32-true, bf16-mixed or 16-mixed (got "
                                                  "transformer-engine: the step keeps float32 weights and optimizer moments)"),
    ("--trainer.strategy", "fsdp", "trainer.strategy ddp or auto (got fsdp: the step averages the gradients of "
                                   "DDP's processes itself; sharded or spawned strategies it does not serve)"),
    ("--trainer.accumulate_grad_batches", "0", "trainer.accumulate_grad_batches an integer >= 1 (got 0)"),
    ("--trainer.devices", "0,1", "trainer.devices a number of processes >= 1 on a CPU (got 0,1: lists of "
                                 "device ids and -1 are for GPUs)"),
    ("--trainer.devices", "-1", "trainer.devices a number of processes >= 1 on a CPU (got -1: lists of "
                                "device ids and -1 are for GPUs)"),
    ("--trainer.devices", "0", "trainer.devices a number of processes >= 1 on a CPU (got 0: lists of "
                               "device ids and -1 are for GPUs)"),
])
def test_settings_the_step_does_not_do_are_refused_in_one_line_before_the_data(tmp_path, run_main, option,
                                                                               value, needs):
    """Through the command: one line, exit status 2, before ZINC is read (its root is empty)."""
    from graphormer_urpe.cli.fit import main

    if option == "--trainer.devices" and torch.cuda.is_available():
        pytest.skip("a CPU's device counts")
    done = run_main(main, ["fit", "--config", REPO / "configs" / "zinc.yaml", "--trainer.default_root_dir",
                           tmp_path / "run", "--trainer.gradient_clip_val", "1.0", "--data.init_args.root",
                           tmp_path / "empty", "--trainer.accelerator", "cpu", option, value])
    assert done.returncode == 2 and done.stderr.strip() == f"graphormer-urpe: error: the training step needs {needs}"
    assert not (tmp_path / "empty").exists()


def test_batches_of_varying_shapes_train_with_the_same_step(zinc_data_root, tmp_path):
    varying = fit(tmp_path / "varying", zinc_data_root, 2, "--data.init_args.static_shapes", "false",
                  "--data.init_args.device_resident", "false")
    assert varying.model._engine.spec.static_shapes is None and varying.trainer.global_step == 2


def test_console_scripts_train_with_the_engine_and_test_its_checkpoint(zinc_data_root, tmp_path):
    """`graphormer-urpe fit` with configs/engine.yaml after configs/compiled.yaml (whose compile and
    Triton kernel it switches off), 6 steps on real ZINC, then `graphormer-urpe test` on its
    checkpoint (an ordinary one) as an earlier version wrote it, with a since retired option."""
    script = Path(sys.executable).with_name("graphormer-urpe")
    common = ["--config", str(REPO / "configs" / "zinc.yaml"), "--config", str(REPO / "configs" / "compiled.yaml"),
              "--config", str(REPO / "configs" / "engine.yaml"),
              "--trainer.default_root_dir", str(tmp_path / "run"), "--data.init_args.root", str(zinc_data_root),
              "--data.init_args.batch_size", "16", "--trainer.limit_val_batches", "2",
              "--trainer.limit_test_batches", "2", "--trainer.enable_model_summary", "false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    fit = subprocess.run([str(script), "fit", *common, "--trainer.max_steps", "6", "--trainer.log_every_n_steps", "3",
                          "--model.backbone", json.dumps(TINY), "--model.warmup_steps", "2"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert fit.returncode == 0, fit.stderr[-3000:]
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 6 and "engine" not in checkpoint["hyper_parameters"]
    assert not checkpoint["hyper_parameters"]["compile"]
    assert checkpoint["hyper_parameters"]["backbone"]["attention_impl"] == "eager"
    logged = (tmp_path / "run" / "csv" / "version_0" / "metrics.csv").read_text()
    assert "train/loss" in logged and "train/skipped_steps" in logged
    # As an earlier version wrote it: with the since retired option cuda_graphs.
    checkpoint["hyper_parameters"]["cuda_graphs"] = True
    torch.save(checkpoint, tmp_path / "earlier.ckpt")
    test = subprocess.run([str(script), "test", *common, "--ckpt_path", str(tmp_path / "earlier.ckpt")],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert test.returncode == 0, test.stderr[-3000:]
    assert "test/mae" in test.stdout + test.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True], ids=["eager backbone", "compiled backbone"])
def test_captured_step_equals_eager_and_never_syncs(zinc_data_root, compile):
    """On a GPU: the CUDA-graph step trains like Lightning's own eager step (float32 tolerance:
    different kernels), and 100 replays make no device-to-host sync; also with the backbone
    compiled (inductor's kernels recorded in the graph)."""
    def run(engine: bool, steps: int, callbacks=()):
        dm = ZINCDataModule(root=str(zinc_data_root), batch_size=16, device_resident=True, static_shapes=True)
        pl.seed_everything(3, verbose=False)
        module = (GraphormerModule if engine else LightningStep)(
            DataFacts(num_atom_embeddings=dm.num_atom_embeddings, num_bond_embeddings=dm.num_bond_embeddings),
            backbone={**TINY, **NO_DROPOUT}, lr=1e-3, warmup_steps=5, total_steps=200, compile=compile and engine)
        trainer = pl.Trainer(accelerator="gpu", devices=1, max_steps=steps, precision="32-true",
                             gradient_clip_val=5.0, limit_val_batches=0, num_sanity_val_steps=0, logger=False,
                             log_every_n_steps=1000, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, callbacks=list(callbacks))
        trainer.fit(module, datamodule=dm)
        return module

    eager, captured = run(False, 20), run(True, 20)
    assert captured._engine._graphs  # the step was recorded, and replayed below
    reference = dict(eager.named_parameters())
    for name, param in captured.named_parameters():
        torch.testing.assert_close(param, reference[name], rtol=1e-3, atol=1e-4, msg=lambda m: f"{name}: {m}")

    class SyncDebug(pl.Callback):  # "error" from the second step (after the capture) on
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if trainer.global_step == 1:
                torch.cuda.set_sync_debug_mode("error")

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step == 101:
                torch.cuda.set_sync_debug_mode("default")

    try:
        run(True, 101, [SyncDebug()])
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
def test_replays_draw_new_dropout_masks():
    """What the engine relies on for dropout: each replay of a recorded graph draws new random
    numbers from the default CUDA generator."""
    x = torch.ones(4096, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.nn.functional.dropout(x, 0.5)
    masks = []
    for _ in range(3):
        graph.replay()
        masks.append(out.clone())
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])


@pytest.mark.gpu
def test_replays_of_compiled_dropout_draw_new_masks():
    """The same for inductor's dropout, which a compiled backbone inside the engine's graph
    uses: its seeds are drawn on the device, so every replay draws new ones."""
    dropout = torch.compile(lambda x: torch.nn.functional.dropout(x, 0.5) + 0.0)
    x = torch.ones(4096, device="cuda")
    for _ in range(2):  # compiled and run outside the capture first
        dropout(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = dropout(x)
    masks = []
    for _ in range(3):
        graph.replay()
        masks.append(out.clone())
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])
    assert 0.4 < float((masks[0] == 0).float().mean()) < 0.6


def test_fits_refused_or_stopped_in_one_line(zinc_data_root, tmp_path, run_main):
    """Through the command: a resume whose options build another model names each changed field
    before the data is read; a checkpoint folder that is a file is refused before training; a
    learning rate so high that the validation outputs are NaN stops the fit (exit 1, one line) with
    no checkpoint of that model."""
    from graphormer_urpe.cli.fit import main

    def args(run_dir, *extra):
        return ["fit", "--config", REPO / "configs" / "zinc.yaml", "--trainer.default_root_dir", run_dir,
                "--data.init_args.root", zinc_data_root, "--data.init_args.max_hops", "5",
                "--trainer.precision", "32-true", "--trainer.limit_train_batches", "3",
                "--trainer.limit_val_batches", "2", "--trainer.check_val_every_n_epoch", "1",
                "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
                "--model.backbone", json.dumps({**TINY, **NO_DROPOUT}), "--model.warmup_steps", "1",
                "--data.init_args.batch_size", "16", *extra]

    run = tmp_path / "run"
    assert run_main(main, args(run, "--trainer.max_steps", "2")).returncode == 0
    changed = run_main(main, args(run, "--trainer.max_steps", "4", "--ckpt_path", "last",
                                  "--model.backbone.num_layers", "3", "--model.backbone.attention", "rpe"))
    assert changed.returncode == 2 and changed.stderr.strip() == (
        f"graphormer-urpe: error: --ckpt_path {run / 'checkpoints' / 'last.ckpt'} holds another model "
        "(checkpoint's num_layers 2, this run's 3; attention 'urpe', this run's 'rpe'): drop the --model "
        "options that change it, or start a new run")

    (tmp_path / "file").write_text("not a folder")
    into_file = run_main(main, args(tmp_path / "other", "--checkpoint.dirpath", tmp_path / "file"))
    assert into_file.returncode == 2 and into_file.stderr.strip() == (
        f"graphormer-urpe: error: --checkpoint.dirpath {tmp_path / 'file'} cannot be written "
        f"({tmp_path / 'file'} is not a directory)")

    several = run_main(main, ["predict", *args(tmp_path / "predicted")[1:], "--ckpt_path", "last",
                              "--trainer.devices", "2", "--trainer.strategy", "ddp"])
    assert several.returncode == 2 and several.stderr.strip() == (
        "graphormer-urpe: error: graphormer-urpe predict writes one table from one process: give --trainer.devices 1 "
        "(graphormer-urpe-predict --workers N predicts in parallel)")

    diverged = run_main(main, args(tmp_path / "diverged", "--trainer.max_steps", "12", "--model.lr", "1e6"))
    last_line = diverged.stderr.strip().splitlines()[-1]
    assert diverged.returncode == 1 and last_line.startswith("graphormer-urpe: error: "), diverged.stderr[-2000:]
    assert "validation outputs are not finite after step 3 (validation mae: nan): no checkpoint" in last_line
    assert not list((tmp_path / "diverged").glob("checkpoints/*nan*"))

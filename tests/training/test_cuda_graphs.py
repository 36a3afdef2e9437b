"""The shape-stable, sync-free training step that CUDA graphs capture (``cuda_graphs``,
``static_shapes``), checked on CPU: padding changes no loss or gradient, the loss has no
data-dependent shape, the compiled edge encoding equals the eager one, the CLI and the benchmark
run the option (on CPU without graphs)."""
from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from graphormer_urpe.data.batch import BatchPadding
from graphormer_urpe.data.collate import collate
from graphormer_urpe.data.datamodule import ZINCDataModule
from graphormer_urpe.nn.encodings import EdgePathBias
from graphormer_urpe.data.facts import DataFacts
from graphormer_urpe.training.module import GraphormerModule

REPO = Path(__file__).resolve().parents[2]
NO_DROPOUT = {"dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def zinc_module(dm: ZINCDataModule, **kwargs) -> GraphormerModule:
    return GraphormerModule(DataFacts(num_atom_embeddings=dm.num_atom_embeddings,
                                      num_bond_embeddings=dm.num_bond_embeddings), **kwargs)


@pytest.mark.parametrize("attention", ["urpe", "rpe"])
def test_padding_changes_neither_loss_nor_gradients(zinc_data_root, attention):
    """Graphormer-slim on 32 real ZINC training graphs: the batch padded to the split's static
    shape gives the unpadded batch's loss and every parameter's gradient."""
    dm = ZINCDataModule(root=str(zinc_data_root))
    dataset = dm.train_dataset()
    padding = BatchPadding.covering(dataset.num_nodes, dataset.num_edges, 32)
    index = np.random.default_rng(1).choice(len(dataset), 32, replace=False)
    torch.manual_seed(0)
    module = zinc_module(dm, backbone={"attention": attention, **NO_DROPOUT})
    with torch.no_grad():  # C away from 1, so URPE's scale matters
        for scale in module.model.urpe_scales or ():
            scale.delta.normal_(std=0.3)
    grads = []
    for pad in (None, padding):
        batch = collate(dataset.graphs, index, padding=pad)
        module.zero_grad()
        loss = module._loss(module(batch), batch.y)
        loss.backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in module.named_parameters()}))
    (loss, expected), (padded_loss, padded) = grads
    assert collate(dataset.graphs, index, padding=padding).x.shape[1] > collate(dataset.graphs, index).x.shape[1]
    torch.testing.assert_close(padded_loss, loss, rtol=1e-6, atol=1e-6)
    for name, grad in expected.items():
        torch.testing.assert_close(padded[name], grad, rtol=1e-4, atol=1e-7, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("task, y", [
    ("regression", [[0.5, float("nan")], [-1.0, 2.0], [float("nan"), float("nan")]]),
    ("classification", [[1.0, float("nan")], [0.0, 1.0], [float("nan"), 0.0]]),
    ("multiclass", [[2.0], [float("nan")], [0.0]]),
])
def test_loss_masks_unknown_labels_without_a_data_dependent_shape(task, y):
    """The loss equals the boolean-indexed mean over known labels, its gradient is finite, and it
    compiles to one graph in which every size is static (boolean indexing has a size read from
    the data: on a GPU, a host sync)."""
    y = torch.tensor(y)
    module = GraphormerModule(DataFacts(num_atom_embeddings=29, num_bond_embeddings=5, task=task,
                                        num_targets=3 if task == "multiclass" else 2))
    pred = torch.randn(3, 3 if task == "multiclass" else 2, requires_grad=True)
    known = ~torch.isnan(y)
    if task == "regression":
        expected = F.l1_loss(pred[known], y[known])
    elif task == "classification":
        expected = F.binary_cross_entropy_with_logits(pred[known], y[known])
    else:
        expected = F.cross_entropy(pred[known[:, 0]], y[known[:, 0], 0].long())
    loss = module._loss(pred, y)
    torch.testing.assert_close(loss, expected)
    (grad,) = torch.autograd.grad(loss, pred)
    assert torch.isfinite(grad).all()
    torch._dynamo.reset()
    symbolic = []

    def record_symbolic_sizes(graph_module, example_inputs):
        for node in graph_module.graph.nodes:
            value = node.meta.get("example_value")
            if isinstance(value, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in value.shape):
                symbolic.append(node.name)
        return graph_module.forward

    compiled = torch.compile(module._loss, fullgraph=True, dynamic=False, backend=record_symbolic_sizes)
    torch.testing.assert_close(compiled(pred, y), expected)
    assert symbolic == []


def test_compiled_edge_encoding_gathers_like_embedding_bag(zinc_data_root):
    """Under torch.compile EdgePathBias sums hops with a gather (capturable backward) instead of
    embedding_bag: same values and gradients on real ZINC paths."""
    batch = collate(ZINCDataModule(root=str(zinc_data_root)).train_dataset().graphs, np.arange(24))
    torch.manual_seed(0)
    bias = EdgePathBias(num_bond_embeddings=5, num_heads=4, max_hops=5)
    table = torch.randn(5 * batch.edge_attr.shape[0], 4, requires_grad=True)
    hops = batch.path_edges.reshape(-1, 5)
    index = torch.where(hops >= 0, hops, 0) + torch.arange(5, dtype=hops.dtype) * batch.edge_attr.shape[0]
    weights = (hops >= 0).float()
    bag, gathered = bias.sum_hops_bag(table, index, weights), bias.sum_hops_gather(table, index, weights)
    torch.testing.assert_close(gathered, bag)
    grad = torch.randn_like(bag)
    torch.testing.assert_close(*(torch.autograd.grad(out, table, grad)[0] for out in (gathered, bag)))
    torch._dynamo.reset()
    compiled = torch.compile(bias, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(batch.edge_attr, batch.path_edges),
                               bias(batch.edge_attr, batch.path_edges), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("attention", ["urpe", "rpe"])
def test_backbone_traces_to_one_graph_that_inductor_lowers(zinc_data_root, monkeypatch, attention):
    """What CUDA graphs capture: the whole backbone's forward and backward on a padded ZINC batch
    trace to ONE graph (a graph break would split the capture), and every op of both is one that
    inductor lowers itself (an ATen fallback such as embedding_bag's backward may sync), the
    dropout's random numbers aside (inductor replaces them on GPUs)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor import lowering
    from torch._inductor.decomposition import select_decomp_table

    dm = ZINCDataModule(root=str(zinc_data_root))
    dataset = dm.train_dataset()
    batch = collate(dataset.graphs, np.arange(16),
                    padding=BatchPadding.covering(dataset.num_nodes, dataset.num_edges, 16))
    model = zinc_module(dm, backbone={"attention": attention, "num_layers": 2}).model
    # On a GPU _check_batch checks shapes only; its CPU-only id check reads values (a sync).
    monkeypatch.setattr(model, "_check_batch", lambda batch: None)
    graphs, ops = [], set()

    def record(graph_module, example_inputs):
        graphs.append(graph_module)
        ops.update(node.target for node in graph_module.graph.nodes if node.op == "call_function")
        return make_boxed_func(graph_module.forward)

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=record, bw_compiler=record, decompositions=select_decomp_table())
    torch.compile(model.forward, backend=backend, dynamic=False, fullgraph=True)(batch).sum().backward()
    assert len(graphs) == 2  # forward, backward
    left_to_aten = {str(op) for op in ops if isinstance(op, torch._ops.OpOverload)
                    and (op not in lowering.lowerings or op in lowering.fallbacks)}
    assert left_to_aten <= {"aten.rand.default"}


def test_non_finite_loss_stops_training_and_options_are_checked():
    module = GraphormerModule(DataFacts(num_atom_embeddings=29, num_bond_embeddings=5))
    module._check_loss(torch.tensor(0.5))
    with pytest.raises(FloatingPointError, match="training loss is nan at step 0"):
        module._check_loss(torch.tensor(float("nan")), batch_idx=3)
    with pytest.raises(ValueError, match="exclude each other"):
        GraphormerModule(DataFacts(num_atom_embeddings=29, num_bond_embeddings=5), compile=True,
                         cuda_graphs=True)


def test_cuda_graphs_option_trains_on_cpu_without_graphs(zinc_data_root, tmp_path):
    """`graphormer-urpe fit` with the CUDA-graph overlay after the fast one, 3 steps on real ZINC
    on CPU: says that CUDA graphs need a GPU, trains with batches of one shape, and the
    checkpoint keeps the plain parameter names."""
    import subprocess

    script = Path(sys.executable).with_name("graphormer-urpe")
    result = subprocess.run(
        [str(script), "fit", "--config", str(REPO / "configs" / "zinc.yaml"),
         "--config", str(REPO / "configs" / "fast.yaml"), "--config", str(REPO / "configs" / "cuda_graphs.yaml"),
         "--trainer.default_root_dir", str(tmp_path / "run"), "--trainer.max_steps", "3",
         "--trainer.limit_val_batches", "2", "--trainer.enable_model_summary", "false",
         "--model.backbone", json.dumps({"num_layers": 2, "hidden_dim": 16, "ffn_dim": 16, "num_heads": 2}),
         "--model.warmup_steps", "1", "--data.init_args.root", str(zinc_data_root),
         "--data.init_args.batch_size", "16"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "cuda_graphs: CUDA graphs need a GPU; training on cpu without them" in output
    assert "static_shapes: training batches of 16 graphs padded to N=37 nodes" in output
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 3 and checkpoint["hyper_parameters"]["cuda_graphs"]
    assert all(name.startswith(("model.", "val_metrics.", "test_metrics.")) for name in checkpoint["state_dict"])


def load_bench_train(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_train", REPO / "scripts" / "bench_train.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_train", module)  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


def test_bench_train_graphs_path_and_a_failing_row(zinc_data_root, monkeypatch, capsys):
    """bench_train's graphs path runs on CPU; a row that raises is recorded with its error and
    the next row still runs."""
    bench = load_bench_train(monkeypatch)
    run_training = bench.run_training

    def eager_fails(name, attention, path, args):
        if path == "eager":
            raise RuntimeError("boom\nsecond line")
        return run_training(name, attention, path, args)

    monkeypatch.setattr(bench, "run_training", eager_fails)
    assert bench.main(["--device", "cpu", "--presets", "zinc", "--attention", "urpe",
                       "--paths", "eager,graphs,resident@32-true", "--warmup", "1", "--steps", "2",
                       "--zinc-batch", "8", "--skip-data-only", "--zinc-root", str(zinc_data_root)]) == 0
    out = capsys.readouterr().out
    rows = json.loads(out.strip().splitlines()[-1])["training"]
    assert [row["path"] for row in rows] == ["eager", "graphs", "resident@32-true"]
    assert rows[0]["error"] == "RuntimeError: boom"
    assert "failed: RuntimeError: boom" in out
    graphs = rows[1]
    assert graphs["cuda_graphs"] and graphs["static_shapes"] and graphs["matmul_precision"] == "high"
    assert graphs["attention_impl"] == "eager" and graphs["precision"] == "32-true" and graphs["ms_per_step"] > 0
    assert graphs["compiled_graphs"] == 0  # on CPU the captured path trains eagerly
    assert rows[2]["ms_per_step"] > 0 and not rows[2]["compile"] and "compiled_graphs" not in rows[2]
    assert torch.get_float32_matmul_precision() == "highest"  # restored after the row


def test_cuda_graphs_overlay_follows_the_fast_overlay():
    from graphormer_urpe.training.cli import build_cli

    cli = build_cli(["--config", str(REPO / "configs" / "zinc.yaml"), "--config", str(REPO / "configs" / "fast.yaml"),
                     "--config", str(REPO / "configs" / "cuda_graphs.yaml")], run=False)
    hparams = cli.model.hparams
    assert hparams.cuda_graphs and not hparams.compile and hparams.matmul_precision == "high"
    assert hparams.backbone["attention_impl"] == "eager" and hparams.backbone["attention"] == "urpe"
    assert cli.datamodule.static_shapes and cli.datamodule.device_resident
    assert str(cli.trainer.precision) == "32-true"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_captured_training_equals_eager_training_on_a_gpu(zinc_data_root):
    """On a GPU: 6 steps with the backbone captured in CUDA graphs reach the weights of 6 eager
    steps over the same padded batches (no dropout)."""
    import lightning.pytorch as pl

    weights = []
    for cuda_graphs in (False, True):
        dm = ZINCDataModule(root=str(zinc_data_root), batch_size=64, device_resident=True, static_shapes=True)
        torch.manual_seed(0)
        module = zinc_module(dm, backbone={"num_layers": 4, **NO_DROPOUT}, cuda_graphs=cuda_graphs,
                             warmup_steps=2, total_steps=20)
        trainer = pl.Trainer(accelerator="cuda", devices=1, max_steps=6, gradient_clip_val=5.0,
                             limit_val_batches=0, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False)
        trainer.fit(module, datamodule=dm)
        weights.append({name: p.detach().cpu() for name, p in module.named_parameters()})
        torch._dynamo.reset()
    for name, expected in weights[0].items():
        torch.testing.assert_close(weights[1][name], expected, rtol=1e-3, atol=1e-5, msg=lambda m: f"{name}: {m}")

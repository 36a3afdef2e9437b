"""The shape-stable, sync-free training step that a GPU records in a CUDA graph (the training
engine on ``static_shapes`` batches), checked on CPU: padding changes no loss or gradient, the
loss has no data-dependent shape, the compiled edge encoding equals the eager one, and the whole
step at the paper's ZINC recipe shape makes no host read, no data-dependent shape, and keeps
every buffer in place across steps."""
from __future__ import annotations

import math
import os
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from graphormer_urpe.data.batch import BatchPadding
from graphormer_urpe.data.batch import collate
from graphormer_urpe.data import ZINCDataModule
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


def test_compiled_edge_encoding_counts_bonds_like_the_cpu_form(zinc_data_root):
    """Under torch.compile EdgePathBias takes its static form (bond counts times the per-hop
    tables) instead of the CPU's packed sum: one graph, the same values on real ZINC paths."""
    batch = collate(ZINCDataModule(root=str(zinc_data_root)).train_dataset().graphs, np.arange(24))
    torch.manual_seed(0)
    bias = EdgePathBias(num_bond_embeddings=5, num_heads=4, max_hops=5)
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


#: Operators a CUDA graph cannot record: a value read back to the host, or an output whose shape
#: depends on the data (boolean indexing is checked apart: its nonzero runs below the mode).
NOT_CAPTURABLE = frozenset({"_local_scalar_dense", "item", "nonzero", "nonzero_static", "masked_select",
                            "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive", "equal",
                            "is_nonzero", "repeat_interleave", "bincount", "masked_scatter", "argwhere"})


class CaptureGuard(TorchDispatchMode):
    """Records every operator that a CUDA graph could not hold (:data:`NOT_CAPTURABLE`, and
    indexing with a boolean mask), with the line of this project that called it."""

    def __init__(self) -> None:
        super().__init__()
        self.refused: list[str] = []
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        name = func._overloadpacket.__name__
        masks = name in ("index", "index_put", "index_put_", "_index_put_impl_") and any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
            for i in (args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()))
        if name in NOT_CAPTURABLE or masks:
            caller = next((f"{frame.filename}:{frame.lineno}" for frame in reversed(traceback.extract_stack())
                           if "graphormer_urpe" in frame.filename), "?")
            self.refused.append(f"aten.{name} at {caller}")
        return func(*args, **kwargs)


def test_capture_guard_catches_host_reads_and_data_dependent_shapes():
    """The guard the two tests below rely on: it names a host read, a boolean mask and a
    nonzero, and lets fixed-shape work through."""
    x = torch.arange(6.0)
    with CaptureGuard() as guard:
        torch.where(x > 2, x, 0.0).sum().mul(2)
    assert guard.refused == [] and guard.ops >= 4
    with CaptureGuard() as guard:
        float(x.sum())
        x[x > 2]
        (x > 2).nonzero()
    assert [entry.split(" at ")[0] for entry in guard.refused] == [
        "aten._local_scalar_dense", "aten.index", "aten.nonzero"]


def tensor_addresses(tensors) -> dict[str, int]:
    return {name: t.data_ptr() for name, t in tensors.items() if isinstance(t, torch.Tensor)}


def optimizer_addresses(optimizer) -> dict[str, int]:
    return {f"{index}.{key}": value.data_ptr()
            for index, (param, state) in enumerate(optimizer.state.items())
            for key, value in state.items() if isinstance(value, torch.Tensor)}


#: The paper's ZINC recipe (configs/zinc.yaml): Graphormer-slim + URPE, batch 256, 20 hops,
#: dropout 0.1 in the inputs, residual branches and attention.
RECIPE_BACKBONE = {"attention": "urpe", "dropout": 0.1, "attention_dropout": 0.1, "activation_dropout": 0.0}


def test_engine_step_at_the_recipe_shape_is_capturable(zinc_data_root):
    """One run (W = 1): the training engine's whole step, as a GPU records it (``static_shapes``),
    at the recipe's shape with dropout on and clipping, runs 3 steps without an operator a CUDA
    graph refuses, and keeps parameters, AdamW state, the learning rates and the step's input
    buffers at the same addresses from step 2 on (a replayed graph reads and writes fixed
    addresses; its gradients live in the graph's own memory pool, so they are not kept between
    eager steps)."""
    import lightning.pytorch as pl

    torch.set_num_threads(os.cpu_count() or 1)  # large tensors: all cores (the fixture restores 1)
    dm = ZINCDataModule(root=str(zinc_data_root), batch_size=256, max_hops=20, device_resident=True,
                        static_shapes=True)
    pl.seed_everything(0, verbose=False)
    module = GraphormerModule(DataFacts.of(dm), preset="slim", backbone=RECIPE_BACKBONE,
                              warmup_steps=2, total_steps=10)
    graphs = dm.train_dataset().graphs  # the forward a GPU records, on this CPU
    module.model.use_static_shapes(graphs.x, graphs.edge_attr)
    engine = module._engine
    guard, addresses, losses = CaptureGuard(), [], []
    step = engine._step

    def guarded_step(batch=None, update=True):
        assert batch is None and update  # the engine gathers the batch itself, inside the step
        with guard:
            step()
        losses.append(float(engine.loss))
        addresses.append({**tensor_addresses({n: p for n, p in module.named_parameters()}),
                          **optimizer_addresses(engine.optimizer),
                          **tensor_addresses({name: getattr(engine, name) for name in (
                              "order", "start", "offsets", "updates", "found_inf", "loss", "loss_total",
                              "weights")}),
                          **tensor_addresses({f"count{i}": t for i, t in enumerate(engine.counts.tensors())}),
                          **tensor_addresses({f"lr{i}": lr for i, lr in enumerate(engine.lrs)})})

    engine._step = guarded_step
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=3, precision="32-true", gradient_clip_val=5.0,
                         limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, datamodule=dm)
    assert trainer.global_step == 3 and len(losses) == 3 and all(map(math.isfinite, losses))
    assert engine.spec.static_shapes is not None  # the step gathered its batches itself
    # every encoding with a static form took it (the model's list of them is complete)
    assert [m for m in module.model.modules() if getattr(m, "static_shapes", True) is not True] == []
    assert guard.ops > 1000 and guard.refused == []
    assert addresses[1] == addresses[2]
    assert len(addresses[2]) > 3 * len(list(module.parameters()))  # parameters, two moments, step

"""GraphormerModule's optimizer: one AdamW param group per kind of parameter."""
from __future__ import annotations

import pytest
import torch

from graphormer_urpe.data.facts import DataFacts
from graphormer_urpe.training.module import GraphormerModule, accumulated_share
from graphormer_urpe.training.optim import PARAMETER_KINDS, parameter_groups

TINY = {"num_layers": 2, "hidden_dim": 16, "ffn_dim": 16, "num_heads": 2}


def _module(**kwargs) -> GraphormerModule:
    return GraphormerModule(DataFacts(num_atom_embeddings=29, num_bond_embeddings=5), backbone=TINY,
                            **{"warmup_steps": 10, "total_steps": 100, **kwargs})


def test_every_parameter_is_in_exactly_one_named_group():
    module = _module()
    groups = parameter_groups(module, 0.01)
    assert [g["name"] for g in groups] == list(PARAMETER_KINDS)
    ids = [id(p) for g in groups for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in module.parameters())
    kinds = {g["name"]: {id(p) for p in g["params"]} for g in groups}
    model = module.model
    assert id(model.urpe_scales[0].delta) in kinds["urpe_scale"]
    assert id(model.final_norm.weight) in kinds["layernorm"]
    assert id(model.head.bias) in kinds["bias"] and id(model.head.weight) in kinds["weight"]
    assert id(model.edge_bias.hop_weight) in kinds["weight"]
    for table in (model.atom_encoder.embedding.weight, model.graph_token.weight,
                  model.virtual_distance.weight, model.spatial_bias.embedding.weight):
        assert id(table) in kinds["embedding"]


def _table_kind(module: torch.nn.Module, name: str) -> str:
    """The kinds as a per-module table assigned them before the rule (parameter_kind)."""
    from graphormer_urpe.nn.encodings import EdgePathBias, GraphToken, URPEScale, VirtualDistanceBias

    if isinstance(module, URPEScale):
        return "urpe_scale"
    if isinstance(module, torch.nn.LayerNorm):
        return "layernorm"
    if isinstance(module, (torch.nn.Embedding, GraphToken, VirtualDistanceBias)):
        return "embedding"
    if isinstance(module, torch.nn.Linear) and name == "bias":
        return "bias"
    assert isinstance(module, (torch.nn.Linear, EdgePathBias)), type(module)
    return "weight"


@pytest.mark.parametrize("backbone", [{"attention": "urpe"}, {"attention": "rpe"}])
def test_todays_model_keeps_the_groups_of_the_table(backbone):
    module = GraphormerModule(DataFacts(num_atom_embeddings=29, num_bond_embeddings=5,
                                        node_encodings={"rwse": 4}), backbone={**TINY, **backbone})
    expected: dict[str, list[int]] = {kind: [] for kind in PARAMETER_KINDS}
    for sub in module.modules():
        for name, param in sub.named_parameters(recurse=False):
            expected[_table_kind(sub, name)].append(id(param))
    groups = parameter_groups(module, 0.01)
    assert {g["name"]: [id(p) for p in g["params"]] for g in groups} == {
        kind: ids for kind, ids in expected.items() if ids}


def test_a_new_module_type_gets_a_group_by_rule():
    model = torch.nn.Sequential(torch.nn.Conv1d(2, 3, 1), torch.nn.BatchNorm1d(3), torch.nn.RMSNorm(3),
                                torch.nn.EmbeddingBag(7, 3), torch.nn.Bilinear(3, 3, 2))
    kinds = {g["name"]: {id(p) for p in g["params"]} for g in parameter_groups(model, 0.01)}
    conv, batch_norm, rms_norm, bag, bilinear = model
    assert kinds == {"weight": {id(conv.weight), id(bilinear.weight)},
                     "embedding": {id(bag.weight)},
                     "bias": {id(conv.bias), id(bilinear.bias)},
                     "layernorm": {id(batch_norm.weight), id(batch_norm.bias), id(rms_norm.weight)}}


def test_no_weight_decay_exempts_kinds_and_rejects_unknown_ones():
    optimizer = _module(weight_decay=0.1,
                        no_weight_decay=["layernorm", "bias"]).configure_optimizers()["optimizer"]
    assert {g["name"]: g["weight_decay"] for g in optimizer.param_groups} == {
        "weight": 0.1, "embedding": 0.1, "bias": 0.0, "layernorm": 0.0, "urpe_scale": 0.1}
    with pytest.raises(ValueError, match="unknown parameter kinds.*'norm'.*choose from"):
        parameter_groups(_module(), 0.1, ["norm"])


def test_decay_alone_keeps_c_at_one():
    """A step with no gradient on C: the decay of ``delta = C - 1`` leaves C exactly 1."""
    module = _module(lr=0.1, weight_decay=1.0, warmup_steps=0, total_steps=10)
    optimizer = module.configure_optimizers()["optimizer"]
    for param in module.parameters():
        param.grad = torch.zeros_like(param)
    for _ in range(3):
        optimizer.step()
    tables = module.model.urpe_scale_tables()
    assert torch.equal(tables, torch.ones_like(tables))
    assert module.model.final_norm.weight.max() < 1  # fairseq's recipe: LayerNorm decays too


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_the_step_uses_the_fused_adamw_capturable_on_a_gpu(precision):
    """The one training step clips itself and skips a non-finite step with the fused AdamW's
    found_inf, so the optimizer is always the fused one, at any precision; on a GPU capturable
    (the step is recorded in a CUDA graph)."""
    import lightning.pytorch as pl

    module = _module()
    module.trainer = pl.Trainer(accelerator="cpu", precision=precision, max_steps=100, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False)
    optimizer = module.configure_optimizers()["optimizer"]
    assert optimizer.defaults["fused"] is True and optimizer.defaults["capturable"] is False
    module._device = torch.device("cuda", 0)  # what a CUDA run reports; the flags are only read
    assert module.configure_optimizers()["optimizer"].defaults["capturable"] is True


def test_a_cycles_gradients_of_two_processes_continue_on_one_or_three():
    """The gradients that 2 processes had summed inside an accumulation cycle: resumed on 2, each
    its own; on 1 or 3 (the same global batch), the first process continues their sum (a
    parameter neither had a gradient for stays without one) and the others start from zero."""
    states = [{"gradients": [torch.tensor([1.0, 2.0]), None, torch.tensor([5.0])],
               "loss_total": torch.tensor(3.0), "weights": torch.tensor(4.0)},
              {"gradients": [torch.tensor([10.0, 20.0]), None, None],
               "loss_total": torch.tensor(6.0), "weights": torch.tensor(2.0)}]
    assert accumulated_share(states, 1, 2) is states[1]
    for world_size in (1, 3):
        first = accumulated_share(states, 0, world_size)
        assert torch.equal(first["gradients"][0], torch.tensor([11.0, 22.0])) and first["gradients"][1] is None
        assert torch.equal(first["gradients"][2], torch.tensor([5.0]))
        assert float(first["loss_total"]) == 9.0 and float(first["weights"]) == 6.0
    other = accumulated_share(states, 2, 3)
    assert other["gradients"] == [None, None, None] and float(other["loss_total"]) == float(other["weights"]) == 0.0

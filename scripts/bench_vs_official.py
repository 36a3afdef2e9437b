"""One CPU training step of Graphormer-slim, this package against official Graphormer v1's model
code, side by side on the same real ZINC-12k batch with the same weights.

Official Graphormer v1 (microsoft/Graphormer, branch ``v1.0``) is not a dependency: point
``--official`` at its ``graphormer/`` directory (e.g. ``git clone -b v1.0
https://github.com/microsoft/Graphormer /tmp/graphormer_v1``; ``--official
/tmp/graphormer_v1/graphormer``). Its ``model.py`` is imported as it is; only the modules it
imports for training (``data``, ``pytorch_lightning``) are stood in for.

Both models get the ZINC-12k recipe's backbone (``configs/zinc.yaml``: 12 x 80, 8 heads, 20-hop
edge paths, dropout 0.1 on the input and residual branches, attention dropout 0.1) and the same
batches: ``--batches`` consecutive batches of ``--batch-size`` test graphs (the exact official
ZINC-12k test graphs; batch ``i`` holds graphs ``i * batch_size ..``), turned into v1's inputs
from this package's encoding (so both see the same shortest paths). Our weights are copied into
v1's tables first, and the outputs are compared in float64 with dropout off on every batch
(``agreement`` in the JSON: the largest difference; v1's unused table rows are zeroed, its
out-degree table too, as v1 indexes it with the in-degree). Then each step, forward + L1 loss +
backward + ``torch.optim.AdamW``, float32, dropout on, alternates between official, ours RPE and
ours URPE in one process, and the batches rotate: step ``i`` of every model takes batch
``i % batches``. The table shows the median of ``--steps`` after ``--warmup`` untimed steps, over
all batches, and the ratio to official per batch (its median step on that batch).

    python scripts/bench_vs_official.py --official /tmp/graphormer_v1/graphormer --data-root data
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types
from pathlib import Path

import torch

from graphormer_urpe.data import ZINCDataModule
from graphormer_urpe.nn.graphormer import Graphormer

#: configs/zinc.yaml's backbone and hops (Graphormer v1's benchmarking-gnns script).
RECIPE = {"dropout": 0.1, "attention_dropout": 0.1, "activation_dropout": 0.0}
MAX_HOPS = 20


def import_official(path: Path):
    """v1's ``model.Graphormer`` with stand-ins for the training-only imports."""
    import lightning.pytorch

    data = types.ModuleType("data")
    data.get_dataset = lambda name: {"num_class": 1, "evaluator": None, "metric": "mae",
                                     "loss_fn": torch.nn.functional.l1_loss}
    sys.modules.setdefault("pytorch_lightning", lightning.pytorch)
    sys.modules["data"] = data
    sys.path.insert(0, str(path))
    import model as official_model  # noqa: E402  (v1's graphormer/model.py)

    return official_model.Graphormer


def official_inputs(batch) -> types.SimpleNamespace:
    """v1's collated batch (``collator.py``) for the same graphs and the same paths: ids shifted
    as v1 shifts them (atom +1, degree +1, spd +1, hop bonds +1; 0 = padding / absent hop)."""
    b, n = batch.node_mask.shape
    mask = batch.node_mask
    x = torch.where(mask[..., None], batch.x.long() + 1, 0)
    degree = torch.where(mask, batch.degree.long() + 1, 0)
    spatial_pos = torch.where(batch.spd >= 0, batch.spd.long() + 1, 0)
    hops = int((batch.path_edges >= 0).sum(-1).max())
    path = batch.path_edges[..., :hops].long()
    bond = batch.edge_attr.long()[path.clamp_min(0)] + 1  # [B, N, N, hops, Fe]
    edge_input = torch.where((path >= 0)[..., None], bond, 0)
    attn_bias = torch.zeros(b, n + 1, n + 1)
    attn_bias[:, :, 1:].masked_fill_(~mask[:, None, :], float("-inf"))
    return types.SimpleNamespace(x=x, in_degree=degree, out_degree=degree, spatial_pos=spatial_pos,
                                 edge_input=edge_input, attn_bias=attn_bias, attn_edge_type=None,
                                 y=batch.y.view(-1))


def copy_weights(ours: Graphormer, official: torch.nn.Module) -> None:
    """Our weights into v1's modules; v1's rows that our ids never reach are zeroed."""
    h = ours.num_heads
    with torch.no_grad():
        for p in official.parameters():
            p.zero_()
        official.atom_encoder.weight[1:1 + ours.atom_encoder.embedding.num_embeddings] = \
            ours.atom_encoder.embedding.weight
        official.in_degree_encoder.weight[:ours.degree_encoder.embedding.num_embeddings] = \
            ours.degree_encoder.embedding.weight  # both: slot 0 padding, degree d at d + 1
        official.edge_encoder.weight[1:1 + ours.edge_bias.embedding.num_embeddings] = \
            ours.edge_bias.embedding.weight
        k = ours.edge_bias.hop_weight.shape[0]
        official.edge_dis_encoder.weight.view(-1, h, h)[:k] = ours.edge_bias.hop_weight
        official.spatial_pos_encoder.weight[1:1 + ours.max_spd + 1] = \
            ours.spatial_bias.embedding.weight[:ours.max_spd + 1]
        official.graph_token.weight[0] = ours.graph_token.weight
        official.graph_token_virtual_distance.weight[0] = ours.virtual_distance.weight
        for mine, theirs in zip(ours.layers, official.layers):
            q, k_, v = mine.attn.in_proj.weight.chunk(3)
            qb, kb, vb = mine.attn.in_proj.bias.chunk(3)
            sa = theirs.self_attention
            for lin, w, bias in ((sa.linear_q, q, qb), (sa.linear_k, k_, kb), (sa.linear_v, v, vb),
                                 (sa.output_layer, mine.attn.out_proj.weight, mine.attn.out_proj.bias),
                                 (theirs.ffn.layer1, mine.ffn[0].weight, mine.ffn[0].bias),
                                 (theirs.ffn.layer2, mine.ffn[3].weight, mine.ffn[3].bias)):
                lin.weight.copy_(w)
                lin.bias.copy_(bias)
            theirs.self_attention_norm.load_state_dict(mine.attn_norm.state_dict())
            theirs.ffn_norm.load_state_dict(mine.ffn_norm.state_dict())
        official.final_ln.load_state_dict(ours.final_norm.state_dict())
        official.downstream_out_proj.load_state_dict(ours.head.state_dict())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--official", type=Path, required=True,
                        help="official Graphormer v1's graphormer/ directory (branch v1.0)")
    parser.add_argument("--data-root", default="data", help="ZINCDataModule root (default: data)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--batches", type=int, default=5, help="test batches, rotating step by step")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per model (median)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    if not (args.official / "model.py").is_file():
        parser.error(f"--official {args.official}: no model.py there (give v1's graphormer/ directory)")
    if args.threads:
        torch.set_num_threads(args.threads)
    OfficialGraphormer = import_official(args.official)

    dm = ZINCDataModule(root=args.data_root, max_hops=MAX_HOPS, batch_size=args.batch_size)
    dm.prepare_data()
    dm.setup("test")
    loader = iter(dm.test_dataloader())  # in order: batch i holds test graphs i * batch_size ..
    batches = [next(loader) for _ in range(args.batches)]
    theirs_batches = [official_inputs(batch) for batch in batches]

    def ours(attention: str) -> Graphormer:
        torch.manual_seed(0)
        return Graphormer.from_preset("slim", num_atom_embeddings=dm.num_atom_embeddings,
                                      num_bond_embeddings=dm.num_bond_embeddings,
                                      max_hops=MAX_HOPS, attention=attention, **RECIPE)

    models = {"ours URPE": ours("urpe"), "ours RPE": ours("rpe")}
    official = OfficialGraphormer(
        n_layers=12, num_heads=8, hidden_dim=80, dropout_rate=RECIPE["dropout"],
        intput_dropout_rate=RECIPE["dropout"], weight_decay=0.01, ffn_dim=80, dataset_name="ZINC",
        warmup_updates=40000, tot_updates=400000, peak_lr=2e-4, end_lr=1e-9, edge_type="multi_hop",
        multi_hop_max_dist=MAX_HOPS, attention_dropout_rate=RECIPE["attention_dropout"])
    copy_weights(models["ours RPE"], official)
    agreement = 0.0
    with torch.no_grad():  # the same function: float64, dropout off
        for batch, theirs_batch in zip(batches, theirs_batches):
            mine = models["ours RPE"].double().eval()(batch)
            theirs = official.double().eval()(types.SimpleNamespace(
                **{**vars(theirs_batch), "attn_bias": theirs_batch.attn_bias.double()}))
            agreement = max(agreement, float((mine - theirs).abs().max()))
    official.float().train()
    models = {"official v1": official, **{k: m.float().train() for k, m in models.items()}}
    step_fns = {}
    for name, model in models.items():
        optimizer = torch.optim.AdamW(model.parameters(), lr=2e-4, weight_decay=0.01)
        inputs = theirs_batches if name == "official v1" else batches

        def step(index, model=model, optimizer=optimizer, inputs=inputs):
            optimizer.zero_grad(set_to_none=True)
            loss = torch.nn.functional.l1_loss(model(inputs[index]).view(-1), batches[index].y.view(-1))
            loss.backward()
            optimizer.step()
        step_fns[name] = step

    times = {name: [[] for _ in batches] for name in step_fns}
    for i in range(args.warmup + args.steps):
        for name, step in step_fns.items():
            start = time.perf_counter()
            step(i % len(batches))
            if i >= args.warmup:
                times[name][i % len(batches)].append(time.perf_counter() - start)
    medians = {name: 1e3 * statistics.median([t for per_batch in ts for t in per_batch])
               for name, ts in times.items()}
    per_batch = {name: [1e3 * statistics.median(t) for t in ts] for name, ts in times.items()}
    ratios = {name: [ms / base for ms, base in zip(per_batch[name], per_batch["official v1"])]
              for name in times}
    base = medians["official v1"]
    sizes = [int(batch.node_mask.shape[1]) for batch in batches]
    print(f"ZINC-12k test graphs 0..{args.batches * args.batch_size - 1} in {args.batches} batches of "
          f"{args.batch_size} (N={', '.join(map(str, sizes))}; {MAX_HOPS} hops), slim, float32, "
          f"{torch.get_num_threads()} thread(s); median of {args.steps} alternating steps")
    print(f"{'model':<12} {'ms/step':>9} {'vs official':>12}   per batch vs official")
    for name, ms in medians.items():
        print(f"{name:<12} {ms:>9.1f} {ms / base:>11.2f}x   " + " ".join(f"{r:.2f}" for r in ratios[name]))
    print(f"outputs, ours RPE vs official with the same weights (float64, eval): max |diff| {agreement:.1e}")
    result = {"official_ms": round(base, 1), "rpe_ms": round(medians["ours RPE"], 1),
              "urpe_ms": round(medians["ours URPE"], 1),
              "urpe_vs_official": round(medians["ours URPE"] / base, 3),
              "rpe_vs_official": round(medians["ours RPE"] / base, 3),
              "urpe_vs_official_per_batch": [round(r, 3) for r in ratios["ours URPE"]],
              "rpe_vs_official_per_batch": [round(r, 3) for r in ratios["ours RPE"]],
              "agreement": agreement, "batch_size": args.batch_size, "batches": args.batches,
              "max_nodes": sizes, "threads": torch.get_num_threads(), "steps": args.steps}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

"""One CPU training step of Graphormer-slim, this package against official Graphormer v1's model
code, side by side on the same real ZINC-12k graphs, v1 fed by its own data pipeline.

Official Graphormer v1 (microsoft/Graphormer, branch ``v1.0``) is not a dependency: point
``--official`` at its ``graphormer/`` directory (e.g. ``git clone -b v1.0
https://github.com/microsoft/Graphormer /tmp/graphormer_v1``; ``--official
/tmp/graphormer_v1/graphormer``). Its ``model.py``, ``wrapper.py`` and ``collator.py`` are
imported as they are; only ``data`` (its LightningDataModule, training only) and
``pytorch_lightning`` are stood in for, and ``algos`` (its Cython ``algos.pyx``) is compiled by
``pyximport`` as v1 does where Cython is installed, else replaced by :data:`V1_ALGOS`, a line by
line port (same distances, same paths, v1's path-through-node-0 quirk included).

Batches: for each ``--seeds`` value, one batch of ``--batch-size`` ZINC-12k test graphs (the
exact official test graphs) drawn at random without replacement (``torch.randperm`` seeded with
it), a training loader's batch. Ours collate it with this package's collator; v1 gets, for the
same graphs, ``collator(items, max_node=128, multi_hop_max_dist=20, spatial_pos_max=1024)`` of
``MyZINCDataset`` items (``preprocess_item``: Floyd-Warshall paths), i.e. exactly what v1's
ZINC training loader gives it with the benchmarking-gnns recipe (``--multi_hop_max_dist 20``).

Both models get the ZINC-12k recipe's backbone (``configs/zinc.yaml``: 12 x 80, 8 heads, 20-hop
edge paths, dropout 0.1 on the input and residual branches, attention dropout 0.1). Our weights
are copied into v1's tables and the outputs are compared in float64 with dropout off on v1's
batches rebuilt from our encoding (``agreement`` in the JSON: the largest difference; the same
shortest paths as ours, as v1's Floyd-Warshall may pick another path of the same length). Then
each step, forward + L1 loss + backward + ``torch.optim.AdamW``, float32, dropout on, alternates
between official, ours URPE and ours RPE in one process, the order rotating every round, and the
batches rotate: round ``i`` takes batch ``i % batches``. One untimed round on every batch first
(``--warmup`` rounds per batch), then ``--steps`` timed steps per model and batch; batches are
built before timing. The table shows, per model, the median over all timed steps and the ratio
to official per batch (medians on that batch).

    python scripts/bench_vs_official.py --official /tmp/graphormer_v1/graphormer --data-root data
"""
from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
import types
from pathlib import Path

import numpy as np
import torch

from graphormer_urpe.data import ZINCDataModule
from graphormer_urpe.nn.graphormer import Graphormer

#: configs/zinc.yaml's backbone and hops (Graphormer v1's benchmarking-gnns script).
RECIPE = {"dropout": 0.1, "attention_dropout": 0.1, "activation_dropout": 0.0}
MAX_HOPS = 20
#: v1's ZINC loader: ``get_dataset('ZINC')['max_node']`` and ``GraphDataModule``'s default.
V1_MAX_NODE, V1_SPATIAL_POS_MAX = 128, 1024
MODELS = ("official v1", "ours URPE", "ours RPE")


def _floyd_warshall(adjacency_matrix):
    """v1's ``algos.floyd_warshall``: distances (510 = unreachable) and the last relaxing node."""
    n = adjacency_matrix.shape[0]
    dist = adjacency_matrix.astype(np.int64, copy=True)
    dist[dist == 0] = 510
    np.fill_diagonal(dist, 0)
    path = np.zeros([n, n], dtype=np.int64)
    for k in range(n):  # row and column k do not change in round k: in place as v1's C loop
        cost = dist[:, k, None] + dist[None, k, :]
        shorter = dist > cost
        dist[shorter] = cost[shorter]
        path[shorter] = k
    far = dist >= 510
    path[far] = dist[far] = 510
    return dist, path


def _all_edges(path, i, j):
    k = path[i][j]
    return [] if k == 0 else _all_edges(path, i, k) + [k] + _all_edges(path, k, j)


def _gen_edge_input(max_dist, path, edge_feat):
    """v1's ``algos.gen_edge_input``: ``[N, N, max_dist, F]`` bond features along each path, -1 absent."""
    n = path.shape[0]
    out = -np.ones([n, n, int(max_dist), edge_feat.shape[-1]], dtype=np.int64)
    for i in range(n):
        for j in range(n):
            if i != j and path[i][j] != 510:
                nodes = [i] + _all_edges(path, i, j) + [j]
                for k in range(len(nodes) - 1):
                    out[i, j, k, :] = edge_feat[nodes[k], nodes[k + 1], :]
    return out


#: A port of v1's ``algos.pyx`` for machines without Cython.
V1_ALGOS = types.SimpleNamespace(floyd_warshall=_floyd_warshall, gen_edge_input=_gen_edge_input)


def import_official(path: Path) -> tuple[types.ModuleType, types.ModuleType, str]:
    """v1's ``model``, ``wrapper`` and ``collator`` modules with stand-ins for the training-only
    imports, and how its ``algos`` was obtained."""
    import lightning.pytorch

    data = types.ModuleType("data")
    data.get_dataset = lambda name: {"num_class": 1, "evaluator": None, "metric": "mae",
                                     "loss_fn": torch.nn.functional.l1_loss}
    sys.modules.setdefault("pytorch_lightning", lightning.pytorch)
    sys.modules["data"] = data
    try:
        importlib.import_module("pyximport")
        algos = "algos.pyx (pyximport)"
    except ImportError:
        stand_in = types.ModuleType("pyximport")
        stand_in.install = lambda **kwargs: None
        sys.modules["pyximport"] = stand_in
        sys.modules["algos"] = types.ModuleType("algos")
        vars(sys.modules["algos"]).update(vars(V1_ALGOS))
        algos = "algos.pyx ported (no Cython)"
    sys.path.insert(0, str(path))
    modules = tuple(importlib.import_module(name) for name in ("model", "wrapper", "collator"))
    return *modules, algos


def converted_inputs(batch) -> types.SimpleNamespace:
    """v1's batch rebuilt from our encoding (our paths; for the agreement check only): ids
    shifted as v1 shifts them (atom +1, degree +1, spd +1, hop bonds +1; 0 = padding / absent)."""
    b, n = batch.node_mask.shape
    mask = batch.node_mask
    x = torch.where(mask[..., None], batch.x.long() + 1, 0)
    degree = torch.where(mask, batch.degree.long() + 1, 0)
    spatial_pos = torch.where(batch.spd >= 0, batch.spd.long() + 1, 0)
    hops = int((batch.path_edges >= 0).sum(-1).max())
    path = batch.path_edges[..., :hops].long()
    bond = batch.edge_attr.long()[path.clamp_min(0)] + 1  # [B, N, N, hops, Fe]
    edge_input = torch.where((path >= 0)[..., None], bond, 0)
    attn_bias = torch.zeros(b, n + 1, n + 1, dtype=torch.float64)
    attn_bias[:, :, 1:].masked_fill_(~mask[:, None, :], float("-inf"))
    return types.SimpleNamespace(x=x, in_degree=degree, out_degree=degree, spatial_pos=spatial_pos,
                                 edge_input=edge_input, attn_bias=attn_bias, attn_edge_type=None)


def copy_weights(ours: Graphormer, official: torch.nn.Module) -> None:
    """Our weights into v1's modules (at the ids of :func:`converted_inputs`); v1's rows that our
    ids never reach are zeroed."""
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


def sample_indices(seed: int, num_graphs: int, batch_size: int) -> list[int]:
    """``batch_size`` of ``num_graphs`` test graphs at random without replacement, from ``seed``."""
    return torch.randperm(num_graphs, generator=torch.Generator().manual_seed(seed))[:batch_size].tolist()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--official", type=Path, required=True,
                        help="official Graphormer v1's graphormer/ directory (branch v1.0)")
    parser.add_argument("--data-root", default="data", help="ZINCDataModule root (default: data)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4],
                        help="one random batch of test graphs per seed (default: 0 1 2 3 4)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per model and batch (median)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds per batch")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    args = parser.parse_args(argv)
    if not (args.official / "model.py").is_file() or not (args.official / "collator.py").is_file():
        parser.error(f"--official {args.official}: no model.py and collator.py there "
                     "(give v1's graphormer/ directory)")
    torch.set_num_threads(args.threads)
    official_model, official_wrapper, official_collator, algos = import_official(args.official)

    dm = ZINCDataModule(root=args.data_root, max_hops=MAX_HOPS, batch_size=args.batch_size)
    dm.prepare_data()
    dm.setup("test")
    test = dm.splits["test"]
    theirs_test = official_wrapper.MyZINCDataset(subset=True, root=str(dm.root), split="test")
    indices = [sample_indices(seed, len(test), args.batch_size) for seed in args.seeds]
    batches = [test.__getitems__(idx) for idx in indices]
    theirs_batches = [official_collator.collator([theirs_test[i] for i in idx], max_node=V1_MAX_NODE,
                                                 multi_hop_max_dist=MAX_HOPS,
                                                 spatial_pos_max=V1_SPATIAL_POS_MAX) for idx in indices]
    for batch, theirs in zip(batches, theirs_batches):
        mask = batch.node_mask[..., None]
        same = (theirs.x.shape[:2] == batch.node_mask.shape and torch.equal(theirs.y, batch.y.view(-1))
                and torch.equal(theirs.x, torch.where(mask, batch.x.long() + 1, 0)))
        if not same:
            raise SystemExit("v1's dataset and ours differ on the same test graphs: "
                             f"{tuple(theirs.x.shape)} vs {tuple(batch.node_mask.shape)}")

    def ours(attention: str) -> Graphormer:
        torch.manual_seed(0)
        return Graphormer.from_preset("slim", num_atom_embeddings=dm.num_atom_embeddings,
                                      num_bond_embeddings=dm.num_bond_embeddings,
                                      max_hops=MAX_HOPS, attention=attention, **RECIPE)

    models = {"ours URPE": ours("urpe"), "ours RPE": ours("rpe")}
    official = official_model.Graphormer(
        n_layers=12, num_heads=8, hidden_dim=80, dropout_rate=RECIPE["dropout"],
        intput_dropout_rate=RECIPE["dropout"], weight_decay=0.01, ffn_dim=80, dataset_name="ZINC",
        warmup_updates=40000, tot_updates=400000, peak_lr=2e-4, end_lr=1e-9, edge_type="multi_hop",
        multi_hop_max_dist=MAX_HOPS, attention_dropout_rate=RECIPE["attention_dropout"])
    copy_weights(models["ours RPE"], official)
    agreement = 0.0
    with torch.no_grad():  # the same function: float64, dropout off
        for batch in batches:
            mine = models["ours RPE"].double().eval()(batch)
            theirs = official.double().eval()(converted_inputs(batch))
            agreement = max(agreement, float((mine - theirs).abs().max()))
    models = {"official v1": official, **models}
    step_fns = {}
    for name, model in models.items():
        model.float().train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=2e-4, weight_decay=0.01)
        inputs = theirs_batches if name == "official v1" else batches

        def step(index, model=model, optimizer=optimizer, inputs=inputs):
            optimizer.zero_grad(set_to_none=True)
            loss = torch.nn.functional.l1_loss(model(inputs[index]).view(-1), batches[index].y.view(-1))
            loss.backward()
            optimizer.step()
        step_fns[name] = step

    nb = len(batches)
    times = {name: [[] for _ in batches] for name in MODELS}
    for i in range((args.warmup + args.steps) * nb):
        order = MODELS[i % 3:] + MODELS[:i % 3]
        for name in order:
            start = time.perf_counter()
            step_fns[name](i % nb)
            if i >= args.warmup * nb:
                times[name][i % nb].append(time.perf_counter() - start)
    medians = {name: 1e3 * statistics.median([t for per_batch in ts for t in per_batch])
               for name, ts in times.items()}
    per_batch = {name: [1e3 * statistics.median(t) for t in ts] for name, ts in times.items()}
    ratios = {name: [ms / base for ms, base in zip(per_batch[name], per_batch["official v1"])]
              for name in times}
    base = medians["official v1"]
    sizes = [int(batch.node_mask.shape[1]) for batch in batches]
    hops = [int(theirs.edge_input.shape[3]) for theirs in theirs_batches]
    print(f"ZINC-12k test graphs, {nb} random batches of {args.batch_size} (seeds "
          f"{', '.join(map(str, args.seeds))}; N={', '.join(map(str, sizes))}; v1's collator: "
          f"{', '.join(map(str, hops))} hops, {algos}), slim, float32, {torch.get_num_threads()} "
          f"thread(s); median of {args.steps} alternating steps per batch")
    print(f"{'model':<12} {'ms/step':>9} {'vs official':>12}   per batch: ms (vs official)")
    for name, ms in medians.items():
        print(f"{name:<12} {ms:>9.1f} {ms / base:>11.2f}x   "
              + " ".join(f"{b:.0f} ({r:.2f})" for b, r in zip(per_batch[name], ratios[name])))
    print(f"outputs, ours RPE vs official with the same weights and paths (float64, eval): "
          f"max |diff| {agreement:.1e}")
    result = {"official_ms": round(base, 1), "rpe_ms": round(medians["ours RPE"], 1),
              "urpe_ms": round(medians["ours URPE"], 1),
              "urpe_vs_official": round(medians["ours URPE"] / base, 3),
              "rpe_vs_official": round(medians["ours RPE"] / base, 3),
              "official_ms_per_batch": [round(ms, 1) for ms in per_batch["official v1"]],
              "urpe_vs_official_per_batch": [round(r, 3) for r in ratios["ours URPE"]],
              "rpe_vs_official_per_batch": [round(r, 3) for r in ratios["ours RPE"]],
              "agreement": agreement, "batch_size": args.batch_size, "seeds": args.seeds,
              "max_nodes": sizes, "official_hops": hops, "official_algos": algos,
              "threads": torch.get_num_threads(), "steps": args.steps}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

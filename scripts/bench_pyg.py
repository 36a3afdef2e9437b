"""What the PyG route costs: GraphormerEncodings + to_graph_batch against the cached pipeline.

On the real ZINC-12k training split (10,000 molecules), one torch thread, ``num_workers=0``,
batches of 64, one pass each, the three ways interleaved over ``--rounds`` rounds (median
reported; the machine may be shared, so compare the rows, not absolute numbers across runs):

- ``transform``: PyG ``ZINC(transform=GraphormerEncodings())``: encodings computed at every access,
  PyG's ``DataLoader`` then ``to_graph_batch``;
- ``pre_transform``: the encodings stored by PyG's ``process()`` once (its time is reported
  separately), PyG's ``DataLoader`` then ``to_graph_batch``;
- ``cached``: this project's ``ZINCDataModule`` train loader (memory-mapped encodings, whole
  batches collated in one call).

    python scripts/bench_pyg.py --zinc-raw data/ZINC/raw

Prints a table, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch


def graphs_per_second(batches, convert=None) -> float:
    start = time.perf_counter()
    count = 0
    for batch in batches:
        graphs = convert(batch) if convert else batch
        count += graphs.num_graphs
    return count / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zinc-raw", type=Path, required=True,
                        help="PyG ZINC raw files (e.g. data/ZINC/raw of a built ZINCDataModule root)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)

    from torch_geometric.datasets import ZINC
    from torch_geometric.loader import DataLoader

    from graphormer_urpe.data import ZINCDataModule
    from graphormer_urpe.data.featurize import ZINC_ATOM_FEATURE_DIMS as ATOMS, ZINC_BOND_FEATURE_DIMS as BONDS
    from graphormer_urpe.data.pyg import GraphormerEncodings, to_graph_batch

    work = Path(tempfile.mkdtemp(prefix="bench_pyg_"))
    try:
        for name in ("plain", "pre"):
            (work / name / "ZINC").mkdir(parents=True)
            (work / name / "ZINC" / "raw").symlink_to(args.zinc_raw.resolve(), target_is_directory=True)
        started = time.perf_counter()
        ZINC(str(work / "plain" / "ZINC"), subset=True, split="train")
        plain_process_s = time.perf_counter() - started
        started = time.perf_counter()
        stored = ZINC(str(work / "pre" / "ZINC"), subset=True, split="train", pre_transform=GraphormerEncodings(5))
        pre_process_s = time.perf_counter() - started
        on_the_fly = ZINC(str(work / "plain" / "ZINC"), subset=True, split="train", transform=GraphormerEncodings(5))
        data = ZINCDataModule(root=str(work / "plain"), subset=True, max_hops=5, batch_size=64, encode_threads=1)
        started = time.perf_counter()
        data.setup("fit")
        cache_build_s = time.perf_counter() - started

        def convert(batch):
            return to_graph_batch(batch, ATOMS, BONDS)

        ways = {
            "transform": lambda: graphs_per_second(DataLoader(on_the_fly, batch_size=64, shuffle=True), convert),
            "pre_transform": lambda: graphs_per_second(DataLoader(stored, batch_size=64, shuffle=True), convert),
            "cached": lambda: graphs_per_second(data.train_dataloader()),
        }
        rates: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(args.rounds):
            for name, measure in ways.items():
                rates[name].append(measure())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    median = {name: statistics.median(values) for name, values in rates.items()}
    print("| path | one-off preparation of 10,000 graphs | graphs/s per pass (median) |")
    print("| --- | --- | ---: |")
    print(f"| PyG transform (encode at every access) + to_graph_batch | PyG process() {plain_process_s:.1f} s "
          f"| {median['transform']:,.0f} |")
    print(f"| PyG pre_transform (encodings stored) + to_graph_batch | PyG process() with encodings "
          f"{pre_process_s:.1f} s | {median['pre_transform']:,.0f} |")
    print(f"| this project's cached loader | encodings cache {cache_build_s:.1f} s (on PyG's processed "
          f"files) | {median['cached']:,.0f} |")
    print(json.dumps({"graphs_per_s": median, "rounds": rates, "plain_process_s": plain_process_s,
                      "pre_transform_process_s": pre_process_s, "cache_build_s": cache_build_s}))


if __name__ == "__main__":
    main()

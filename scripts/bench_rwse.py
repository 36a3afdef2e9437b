"""Cost of the RWSE encoding (:func:`graphormer_urpe.data.encodings.random_walk_return_probabilities`)
on every molecule of ZINC: the train, val and test pickles of PyG's raw ZINC layout (249,456
molecules), encoded in one call, one thread. Prints the time and, as the last line, a JSON object.

    OMP_NUM_THREADS=1 python scripts/bench_rwse.py [--raw data/ZINC/raw] [--steps 16]

The raw pickles are those any ZINC DataModule run writes under ``<root>/ZINC/raw``.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import time
from pathlib import Path

import numpy as np

from graphormer_urpe.data.encodings import random_walk_return_probabilities


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--raw", type=Path, default=Path("data/ZINC/raw"))
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    edges, sizes = [], []
    for split in ("train", "val", "test"):
        with open(args.raw / f"{split}.pickle", "rb") as handle:
            for molecule in pickle.load(handle):
                src, dst = np.nonzero(np.asarray(molecule["bond_type"]) > 0)
                edges.append(np.stack([src, dst]))
                sizes.append(len(molecule["atom_type"]))
    node_ptr = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    edge_ptr = np.concatenate([[0], np.cumsum([e.shape[1] for e in edges])]).astype(np.int64)
    edge_index = np.ascontiguousarray(np.concatenate(edges, axis=1), dtype=np.int64)
    print(f"{len(sizes):,} molecules, {node_ptr[-1]:,} atoms, {edge_ptr[-1]:,} directed edges")
    start = time.perf_counter()
    rwse = random_walk_return_probabilities(node_ptr, edge_index, edge_ptr, args.steps)
    seconds = time.perf_counter() - start
    print(f"RWSE, {args.steps} steps: {seconds:.1f} s, {rwse.nbytes / 2**20:.0f} MiB float32")
    print(json.dumps({"molecules": len(sizes), "steps": args.steps, "seconds": round(seconds, 1),
                      "mib": round(rwse.nbytes / 2**20), "machine": f"{os.cpu_count()}-core CPU"}))


if __name__ == "__main__":
    main()

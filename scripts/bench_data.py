"""Data pipeline benchmark: preprocessing time, reload time and collation throughput.

Measures, on the real data in the local data copies (``--shared``):

1. ZINC-full from SMILES to cached encodings: raw files rebuilt from SMILES (RDKit, worker
   processes), PyG's ``ZINC.process()``, encodings of all three splits (target < 3 min on the
   2-core machine).
2. Second load of ZINC-12k: a fresh ``ZINCDataModule`` on the built root, ``setup`` of every
   split (PyG's processed files + memory-mapped encodings; target < 1 s).
3. Collated graphs/s on one core: one epoch of the ZINC-12k train loader, ``num_workers=0``,
   ``torch.set_num_threads(1)`` (target >= 20,000).
4. PCQM4Mv2 featurize + encode throughput on the 1,999 real molecules (OGB featurizer, worker
   processes) and the implied hours for all 3,746,620 molecules on this machine.

Prints a table, then one JSON line with every number. ``--skip-zinc-full`` builds ZINC from an
existing ``--root`` instead of timing the full rebuild (step 1 then reports null).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from graphormer_urpe.utils.process import usable_cores
from graphormer_urpe.data.local_data import local_data_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shared", type=Path, default=local_data_dir(),
                        help="the local data copies (default: $GRAPHORMER_URPE_DATA or ../shared/data)")
    parser.add_argument("--root", type=Path, default=None,
                        help="data root to build into (default: a temporary directory, removed afterwards)")
    parser.add_argument("--workers", type=int, default=usable_cores(), help="featurization processes")
    parser.add_argument("--max-hops", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--skip-zinc-full", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    from graphormer_urpe.data import PCQM4Mv2DataModule, ZINCDataModule
    from graphormer_urpe.data.ogb_lsc import PCQM4MV2, write_root

    temporary = args.root is None
    root = Path(tempfile.mkdtemp(prefix="bench_data-")) if temporary else args.root
    results: dict[str, float | int | str | None] = {
        "machine": f"{os.cpu_count()}-core CPU", "workers": args.workers, "max_hops": args.max_hops}
    try:
        zinc_source = args.shared / "zinc"
        if not args.skip_zinc_full:
            if (root / "ZINC").exists():
                sys.exit(f"{root / 'ZINC'} exists; the full-rebuild timing needs a fresh root")
            start = time.perf_counter()
            full = ZINCDataModule(root=str(root), subset=False, source_dir=str(zinc_source),
                                  max_hops=args.max_hops, build_workers=args.workers)
            full.prepare_data()
            results["zinc_full_smiles_to_encodings_s"] = time.perf_counter() - start
        else:
            results["zinc_full_smiles_to_encodings_s"] = None
        ZINCDataModule(root=str(root), subset=True, source_dir=str(zinc_source), max_hops=args.max_hops,
                       build_workers=args.workers).prepare_data()

        start = time.perf_counter()
        subset = ZINCDataModule(root=str(root), subset=True, max_hops=args.max_hops, batch_size=args.batch_size)
        for stage in ("fit", "test"):
            subset.setup(stage)
        results["zinc_subset_second_load_s"] = time.perf_counter() - start

        loader = subset.train_dataloader()
        for epoch in range(2):  # epoch 0 warms the page cache; epoch 1 is measured
            loader.sampler.set_epoch(epoch)
            start = time.perf_counter()
            graphs = sum(batch.num_graphs for batch in loader)
            elapsed = time.perf_counter() - start
        results["collated_graphs_per_s_one_core"] = graphs / elapsed

        pcqm_root = root / "pcqm"
        write_root(pcqm_root, args.shared / "pcqm4mv2" / "pcqm4mv2_first2k_3d.csv.gz", PCQM4MV2)
        start = time.perf_counter()
        pcqm = PCQM4Mv2DataModule(root=str(pcqm_root), max_hops=args.max_hops, build_workers=args.workers)
        store = pcqm.store()[0]
        elapsed = time.perf_counter() - start
        results["pcqm4mv2_molecules"] = len(store)
        results["pcqm4mv2_featurize_encode_graphs_per_s"] = len(store) / elapsed
        results["pcqm4mv2_full_extrapolated_h"] = PCQM4MV2.num_molecules / (len(store) / elapsed) / 3600
    finally:
        if temporary:
            shutil.rmtree(root, ignore_errors=True)

    rows = [
        ("ZINC-full SMILES -> cached encodings", results["zinc_full_smiles_to_encodings_s"], "s", "< 180"),
        ("ZINC-12k second load (all splits)", results["zinc_subset_second_load_s"], "s", "< 1"),
        ("collated graphs/s, one core", results["collated_graphs_per_s_one_core"], "graphs/s", ">= 20000"),
        (f"PCQM4Mv2 featurize+encode ({results['pcqm4mv2_molecules']} mols)",
         results["pcqm4mv2_featurize_encode_graphs_per_s"], "graphs/s", ""),
        ("PCQM4Mv2 full (3,746,620) extrapolated", results["pcqm4mv2_full_extrapolated_h"], "h", ""),
    ]
    print(f"{'measurement':45s} {'value':>12s} {'unit':10s} target")
    for name, value, unit, target in rows:
        shown = "skipped" if value is None else f"{value:12.3f}" if value < 100 else f"{value:12.0f}"
        print(f"{name:45s} {shown:>12s} {unit:10s} {target}")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

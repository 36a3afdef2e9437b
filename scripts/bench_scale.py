"""OGB-LSC scale benchmark: memory and speed of a PCQM4Mv2-layout build as the table grows.

For each ``--sizes`` N it writes a PCQM4Mv2-layout root (``pcqm4m-v2/raw/data.csv.gz`` +
``split_dict.pt``) of N DISTINCT SMILES strings and runs, in a fresh child process, what a user
runs: ``PCQM4Mv2DataModule(root, build_workers=W, encode_threads=W).prepare_data()`` (featurize
in W worker processes, Cython encoding, memory-mapped caches), then, in a second fresh child, the
training start on the built cache (``setup("fit")`` and the first training batch).

The molecules: ZINC-full's 249,456 SMILES (``--shared``/zinc, JT-VAE train + valid + test),
then RDKit randomized SMILES of them (``MolToSmiles(doRandom=True)``) until N distinct strings.
The build deduplicates by string, as for the real table, so every string is featurized and
encoded; a randomized SMILES is the same molecule as its source, so a canonical-SMILES
deduplication would collapse them (the build does not do that). N <= 249,456 uses ZINC molecules
only.

Memory is sampled every 0.1 s over the whole process tree (the child and its worker processes):
``tree_pss`` sums the proportional set size (shared pages split between the processes that map
them, so forked workers are not counted twice), ``tree_rss`` sums the resident set sizes (shared
pages counted once per process: an overestimate); ``main_rss`` is the child's own peak
(``VmHWM``). Molecules/s is N over the build's wall-clock time. Extrapolations to PCQM4Mv2's
3,746,620 molecules: time = N_full / (molecules/s per worker * cores), i.e. they assume the
featurization (which dominates) scales linearly with worker processes, which it does in
principle (independent chunks) but was not measured beyond this machine's cores.

Prints a table, then one JSON line with every number.
"""
from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from graphormer_urpe.utils.process import usable_cores
from graphormer_urpe.data.local_data import local_data_dir

FULL_PCQM4MV2 = 3_746_620


def _randomized(args: tuple[list[str], int]) -> list[str]:
    from rdkit import Chem, RDLogger, rdBase

    RDLogger.DisableLog("rdApp.*")
    smiles, seed = args
    rdBase.SeedRandomNumberGenerator(seed)
    return [Chem.MolToSmiles(mol, canonical=False, doRandom=True)
            for mol in map(Chem.MolFromSmiles, smiles) if mol is not None]


def distinct_smiles(zinc: Path, count: int, workers: int) -> list[str]:
    """``count`` distinct SMILES strings: ZINC-full's, then randomized SMILES of them."""
    smiles = []
    for split in ("train", "valid", "test"):
        with gzip.open(zinc / f"jtvae_{split}.smi.gz", "rt") as f:
            smiles.extend(line.strip() for line in f if line.strip())
    seen = dict.fromkeys(smiles)
    base = list(seen)
    rounds = 0
    while len(seen) < count:
        chunks = [(base[s:s + 5000], rounds * 1000 + s // 5000) for s in range(0, len(base), 5000)]
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            for part in pool.imap(_randomized, chunks):
                seen.update(dict.fromkeys(part))
                if len(seen) >= count:
                    break
        rounds += 1
    return list(seen)[:count]


def write_table(root: Path, smiles: list[str]) -> None:
    """The PCQM4Mv2 layout: 90 % train, 5 % valid (gap = row / N), 2.5 % each test split (NaN)."""
    import pandas as pd
    import torch

    from graphormer_urpe.data.ogb_lsc import PCQM4MV2, RAW_TABLE, RELEASE_MARKER, SPLIT_FILE

    n = len(smiles)
    folder = PCQM4MV2.path(root)
    (folder / "raw").mkdir(parents=True, exist_ok=True)
    bounds = [int(n * 0.9), int(n * 0.95), int(n * 0.975)]
    rows = dict(zip(PCQM4MV2.splits, np.split(np.arange(n), bounds)))
    gap = np.arange(n, dtype=np.float64) / n
    gap[bounds[1]:] = np.nan
    with gzip.open(folder / RAW_TABLE, "wt", compresslevel=1) as f:
        pd.DataFrame({"idx": np.arange(n), "smiles": smiles, "homolumogap": gap}).to_csv(f, index=False)
    torch.save({s: r.astype(np.int64) for s, r in rows.items()}, folder / SPLIT_FILE)
    (folder / RELEASE_MARKER).write_text("benchmark table\n")


def _tree(pid: int) -> list[int]:
    pids, stack = [], [pid]
    while stack:
        p = stack.pop()
        pids.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    stack.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return pids


def _rollup(pid: int) -> dict[str, int]:
    fields = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in ("Rss", "Pss", "Pss_Anon", "Pss_File"):
                    fields[name] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return fields


def run_measured(argv: list[str]) -> dict:
    """Run ``argv`` (a Python child) sampling its process tree's memory; the child's JSON line."""
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    peaks = {"tree_pss": 0, "tree_rss": 0, "tree_pss_anon": 0}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            totals = {"tree_pss": 0, "tree_rss": 0, "tree_pss_anon": 0}
            for pid in _tree(process.pid):
                fields = _rollup(pid)
                totals["tree_pss"] += fields.get("Pss", 0)
                totals["tree_rss"] += fields.get("Rss", 0)
                totals["tree_pss_anon"] += fields.get("Pss_Anon", 0)
            for key, value in totals.items():
                peaks[key] = max(peaks[key], value)
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, _ = process.communicate()
    done.set()
    sampler.join()
    if process.returncode:
        raise SystemExit(f"{argv} failed with exit status {process.returncode}")
    result = json.loads(out.strip().splitlines()[-1])
    result.update({key: value / 2**20 for key, value in peaks.items()})  # MiB
    return result


def child_build(root: Path, workers: int) -> None:
    from graphormer_urpe.data import PCQM4Mv2DataModule

    start = time.perf_counter()
    PCQM4Mv2DataModule(root=str(root), build_workers=workers, encode_threads=workers).prepare_data()
    elapsed = time.perf_counter() - start
    work = root / "pcqm4m-v2" / "processed_graphormer_urpe"
    featurized = (work / "graphs" / "manifest.json").stat().st_mtime
    encoded = max(p.stat().st_mtime for p in (work / "encodings").glob("*/manifest.json"))
    print(json.dumps({"build_s": elapsed, "encode_s": encoded - featurized,
                      "main_rss": _vm_hwm() / 2**20}))


def child_train_start(root: Path) -> None:
    from graphormer_urpe.data import PCQM4Mv2DataModule

    start = time.perf_counter()
    data = PCQM4Mv2DataModule(root=str(root), batch_size=256)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    print(json.dumps({"train_start_s": time.perf_counter() - start, "first_batch_graphs": batch.num_graphs,
                      "main_rss": _vm_hwm() / 2**20}))


def _vm_hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shared", type=Path, default=local_data_dir(),
                        help="the local data copies (default: $GRAPHORMER_URPE_DATA or ../shared/data)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[50_000, 220_000, 1_000_000])
    parser.add_argument("--workers", type=int, default=usable_cores(), help="build processes / encode threads")
    parser.add_argument("--root", type=Path, default=None, help="work directory (default: a temporary one)")
    parser.add_argument("--child", nargs=2, metavar=("KIND", "ROOT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        kind, root = args.child
        child_build(Path(root), args.workers) if kind == "build" else child_train_start(Path(root))
        return 0

    temporary = args.root is None
    work = Path(tempfile.mkdtemp(prefix="bench_scale-")) if temporary else args.root
    rows = []
    try:
        smiles = distinct_smiles(args.shared / "zinc", max(args.sizes), args.workers)
        for n in args.sizes:
            root = work / f"n{n}"
            shutil.rmtree(root, ignore_errors=True)
            write_table(root, smiles[:n])
            command = [sys.executable, __file__, "--workers", str(args.workers), "--child"]
            build = run_measured([*command, "build", str(root)])
            start = run_measured([*command, "train_start", str(root)])
            rate = n / build["build_s"]
            rows.append({
                "molecules": n, "build_s": build["build_s"], "encode_s": build["encode_s"],
                "molecules_per_s": rate, "peak_tree_pss_mib": build["tree_pss"],
                "peak_tree_rss_mib": build["tree_rss"], "peak_tree_pss_anon_mib": build["tree_pss_anon"],
                "peak_main_rss_mib": build["main_rss"],
                "train_start_s": start["train_start_s"], "train_start_rss_mib": start["main_rss"],
                "train_start_pss_anon_mib": start["tree_pss_anon"],
                "cache_mib": sum(p.stat().st_size for p in (root / "pcqm4m-v2" / "processed_graphormer_urpe").rglob("*")
                                 if p.is_file()) / 2**20,
            })
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)  # progress, one line per size
            shutil.rmtree(root, ignore_errors=True)
    finally:
        if temporary:
            shutil.rmtree(work, ignore_errors=True)

    largest = rows[-1]
    per_worker = largest["molecules_per_s"] / args.workers
    results = {
        "machine": f"{os.cpu_count()}-core CPU", "workers": args.workers, "date": time.strftime("%Y-%m-%d"),
        "sizes": rows,
        "full_pcqm4mv2_h_2_cores": FULL_PCQM4MV2 / (per_worker * 2) / 3600,
        "full_pcqm4mv2_h_16_cores": FULL_PCQM4MV2 / (per_worker * 16) / 3600,
        "full_pcqm4mv2_cache_gib": largest["cache_mib"] / largest["molecules"] * FULL_PCQM4MV2 / 1024,
    }
    by_size = {row["molecules"]: row for row in rows}
    if 50_000 in by_size and 220_000 in by_size:
        for key in ("peak_tree_pss_mib", "peak_main_rss_mib"):
            results[f"ratio_220k_50k_{key}"] = by_size[220_000][key] / by_size[50_000][key]

    print(f"{'molecules':>10s} {'build s':>8s} {'encode s':>8s} {'mol/s':>7s} {'tree PSS':>9s} {'tree RSS':>9s} "
          f"{'main RSS':>9s} {'start s':>8s} {'start RSS':>9s} {'cache MiB':>9s}")
    for row in rows:
        print(f"{row['molecules']:10d} {row['build_s']:8.1f} {row['encode_s']:8.1f} {row['molecules_per_s']:7.0f} "
              f"{row['peak_tree_pss_mib']:9.0f} {row['peak_tree_rss_mib']:9.0f} {row['peak_main_rss_mib']:9.0f} "
              f"{row['train_start_s']:8.1f} {row['train_start_rss_mib']:9.0f} {row['cache_mib']:9.0f}")
    print(f"full PCQM4Mv2 ({FULL_PCQM4MV2:,}) extrapolated: {results['full_pcqm4mv2_h_2_cores']:.2f} h on 2 cores, "
          f"{results['full_pcqm4mv2_h_16_cores']:.2f} h on 16 cores, cache {results['full_pcqm4mv2_cache_gib']:.1f} GiB")
    for key in [k for k in results if k.startswith("ratio_")]:
        print(f"{key}: {results[key]:.2f}")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

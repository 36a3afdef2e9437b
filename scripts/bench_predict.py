"""Throughput of ``graphormer-urpe-predict`` on real ZINC molecules.

    python scripts/bench_predict.py                       # 20,000 ZINC SMILES, slim ZINC model
    python scripts/bench_predict.py --ckpt runs/zinc_urpe/checkpoints/last.ckpt --workers 1 2

Runs the installed command as users do (a fresh process per setting: startup, checkpoint
verification, featurization, prediction, atomic write) on the first ``--rows`` SMILES of ZINC's
training list (``--zinc``, by default the local data copies' ``zinc/``). Without ``--ckpt`` it saves an untrained
slim ZINC model (speed does not depend on the weights). Prints a table and a final JSON line:
molecules/s over the whole command and after startup (a 3-molecule run's time subtracted), the
largest process's peak RSS, the CPU seconds of all its processes (less sensitive than wall time
to other jobs sharing the machine), and the settings.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from graphormer_urpe.utils.process import usable_cores
from graphormer_urpe.data.local_data import local_data_dir


def slim_zinc_checkpoint(path: Path) -> Path:
    """An untrained Graphormer-slim (URPE) checkpoint with the ZINC featurizer."""
    import lightning
    import torch

    from graphormer_urpe.data.facts import DataFacts
    from graphormer_urpe.data.feature_ids import num_embeddings
    from graphormer_urpe.data.featurize import ZINC_ATOM_FEATURE_DIMS, ZINC_BOND_FEATURE_DIMS
    from graphormer_urpe.training.module import GraphormerModule

    facts = DataFacts(num_embeddings(ZINC_ATOM_FEATURE_DIMS), num_embeddings(ZINC_BOND_FEATURE_DIMS),
                      featurizer="zinc")
    module = GraphormerModule(facts, preset="slim", backbone={"attention": "urpe"})
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams),
                "pytorch-lightning_version": lightning.__version__}, path)
    return path


def timed_run(command: list[str]) -> tuple[float, int, float]:
    """Wall seconds, peak RSS (KiB, the largest process of the run) and CPU seconds (user +
    system, its worker processes included) of ``command``."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)  # rusage of this run alone
    wall = time.perf_counter() - start
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed (exit {process.returncode}):\n"
                         f"{process.stderr.read().decode()}")
    process.stderr.close()
    return wall, usage.ru_maxrss, usage.ru_utime + usage.ru_stime


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ckpt", help="checkpoint to use (default: an untrained slim ZINC model)")
    parser.add_argument("--zinc", default=str(local_data_dir() / "zinc"), help="the ZINC source files")
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 1])
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args(argv)

    command = shutil.which("graphormer-urpe-predict", path=str(Path(sys.executable).parent)) \
        or shutil.which("graphormer-urpe-predict")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ckpt = Path(args.ckpt) if args.ckpt else slim_zinc_checkpoint(tmp / "slim.ckpt")
        with gzip.open(Path(args.zinc) / "jtvae_train.smi.gz", "rt") as handle:
            smiles = [line.strip() for _, line in zip(range(args.rows), handle)]
        (tmp / "in.smi").write_text("\n".join(smiles) + "\n")
        (tmp / "tiny.smi").write_text("\n".join(smiles[:3]) + "\n")

        results = []
        print(f"{'workers':>7} {'rows':>7} {'wall s':>8} {'startup s':>9} {'mol/s':>7} "
              f"{'mol/s after startup':>19} {'peak RSS MiB':>12} {'CPU s':>6}")
        for workers in args.workers:
            for _ in range(args.repeats):
                base = [command, "--ckpt", str(ckpt), "--output", str(tmp / "out.csv"), "--quiet",
                        "--workers", str(workers), "--device", "cpu"]
                startup, _, _ = timed_run([*base, "--input", str(tmp / "tiny.smi")])
                wall, rss, cpu = timed_run([*base, "--input", str(tmp / "in.smi")])
                row = {"workers": workers, "rows": len(smiles), "wall_s": round(wall, 2),
                       "startup_s": round(startup, 2), "mol_per_s": round(len(smiles) / wall, 1),
                       "mol_per_s_after_startup": round(len(smiles) / max(wall - startup, 1e-9), 1),
                       "peak_rss_mib": round(rss / 1024, 1), "cpu_s": round(cpu, 2)}
                results.append(row)
                print(f"{workers:>7} {row['rows']:>7} {wall:>8.2f} {startup:>9.2f} {row['mol_per_s']:>7.1f} "
                      f"{row['mol_per_s_after_startup']:>19.1f} {row['peak_rss_mib']:>12.1f} {cpu:>6.1f}",
                      flush=True)
    best = max(results, key=lambda r: r["mol_per_s"])
    print(json.dumps({"molecules_per_s": best["mol_per_s"],
                      "molecules_per_s_after_startup": best["mol_per_s_after_startup"],
                      "peak_rss_mib": best["peak_rss_mib"], "cpu_s": best["cpu_s"], "best_workers": best["workers"],
                      "rows": len(smiles), "checkpoint": str(args.ckpt or "untrained slim ZINC (URPE)"),
                      "cpu_cores": usable_cores(),
                      "load_average_1min": round(os.getloadavg()[0], 2), "python": platform.python_version(),
                      "runs": results}))


if __name__ == "__main__":
    main()

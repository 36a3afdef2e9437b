"""How long each console command takes to answer ``--help`` (and ``graphormer-urpe recipes``), and
whether it imported torch or Lightning to do it.

Each command is run once, then ``--runs`` times, as a new process (the installed console script
beside this interpreter, as a user types it) with a cache folder of its own; the table gives the
first run's wall time (the training command's help is written by LightningCLI then, and read
back from the cache after), the median and the best of the others, and the heavy libraries found
in ``python -X importtime``'s output of one more run. The last line is a
JSON object ``{command: {"first_s", "median_s", "best_s", "imports": [...]}}``.

    .venv/bin/python scripts/bench_help.py [--runs 5] [--only graphormer-urpe-plot ...]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
#: the libraries whose import a ``--help`` should not need (seconds each on a 2-core CPU)
HEAVY = ("torch", "lightning", "torch_geometric", "rdkit", "matplotlib", "optuna", "pandas")


def commands() -> list[list[str]]:
    """Every console script's ``--help``, then ``graphormer-urpe recipes``."""
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    return [*([name, "--help"] for name in scripts), ["graphormer-urpe", "fit", "--help"],
            ["graphormer-urpe", "recipes"]]


def wall_time(words: list[str], env: dict) -> float:
    start = time.perf_counter()
    done = subprocess.run([str(BIN / words[0]), *words[1:]], capture_output=True, env=env)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(words)}: exit status {done.returncode}: {done.stderr.decode()[-500:]}")
    return seconds


def heavy_imports(words: list[str], env: dict) -> list[str]:
    """The :data:`HEAVY` top-level packages that one run of ``words`` imported."""
    done = subprocess.run([sys.executable, "-X", "importtime", str(BIN / words[0]), *words[1:]],
                          capture_output=True, text=True, env=env)
    imported = {line.split("|")[-1].strip().split(".")[0] for line in done.stderr.splitlines()
                if line.startswith("import time:") and "|" in line}
    return sorted(imported & set(HEAVY))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="runs of each command (default: 5)")
    parser.add_argument("--only", nargs="+", help="only these commands (first words)")
    args = parser.parse_args()
    # a cache folder of this run's own: the first run of each command finds no help kept
    cache = tempfile.TemporaryDirectory(prefix="bench-help-cache-")
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "XDG_CACHE_HOME": cache.name}
    selected = [words for words in commands() if not args.only or words[0] in args.only]
    first = {" ".join(words): wall_time(words, env) for words in selected}  # fills the page cache too
    results = {}
    for words in selected:
        times = [wall_time(words, env) for _ in range(args.runs)]
        results[" ".join(words)] = {"first_s": round(first[" ".join(words)], 3),
                                    "median_s": round(statistics.median(times), 3),
                                    "best_s": round(min(times), 3), "imports": heavy_imports(words, env)}
    cache.cleanup()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load average {load:.2f}; "
          f"{args.runs} runs each")
    width = max(map(len, results)) + 2
    print(f"{'command':<{width}}{'first s':>10}{'median s':>10}{'best s':>10}  heavy imports")
    for name, result in results.items():
        print(f"{name:<{width}}{result['first_s']:>10.2f}{result['median_s']:>10.2f}{result['best_s']:>10.2f}  "
              f"{', '.join(result['imports']) or '-'}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()

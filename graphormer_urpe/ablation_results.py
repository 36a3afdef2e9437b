"""The results of seeded runs (``graphormer-urpe-ablation``): one JSON list, merged under a lock,
and the markdown tables written from it.

Each entry is one finished run: ``recipe``, ``attention`` (the arm), ``seed``, ``steps``, the
task's validation and test metric (``val_mae``, ``test_mae`` for regression), wall time, and the
``device`` and ``commit`` that produced it (:func:`describe_device`, :func:`code_commit`). A table
gives per arm the mean ± sample std over seeds and, per seed, the paired difference ``arm - rpe``.
"""
from __future__ import annotations

import datetime as dt
import fcntl
import os
import platform
import statistics
import subprocess
from pathlib import Path
from typing import Sequence

from graphormer_urpe.files import atomic_write, read_json, write_json
from graphormer_urpe.task import get_task

#: The arm every other arm is compared with, seed by seed (plain Graphormer).
BASELINE = "rpe"
DEFAULT_RESULTS = Path("docs/results/zinc_ablation.json")


# --------------------------------------------------------------------------------------------
# Facts about the machine and the code
# --------------------------------------------------------------------------------------------
def code_commit() -> str:
    """HEAD of the checkout this package is imported from, ``+dirty`` with uncommitted changes
    to tracked files; ``unknown`` outside git."""
    repo = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def describe_device(jobs: int, threads_per_job: int | None) -> str:
    """What a run trains on, in words: the GPU name, or the CPU model, cores and threads."""
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)}, {jobs} run(s) at a time"
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    threads = f"{threads_per_job} thread(s)" if threads_per_job else "default threads"
    return f"CPU {cpu} ({os.cpu_count()} cores), {jobs} run(s) at a time, {threads} each"


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


# --------------------------------------------------------------------------------------------
# The result list
# --------------------------------------------------------------------------------------------
def result_key(entry: dict) -> tuple:
    return entry.get("recipe"), entry["attention"], entry["seed"]


def read_results(path: Path) -> list[dict]:
    """The result list at ``path`` (empty when missing); ``ValueError`` naming the file when it
    is not a JSON list of runs (each with ``attention`` and ``seed``), which is never rewritten."""
    entries = read_json(path, [])
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a JSON list of runs, found {type(entries).__name__}; "
                         "fix or remove it")
    bad = [i for i, e in enumerate(entries) if not (isinstance(e, dict) and {"attention", "seed"} <= set(e))]
    if bad:
        raise ValueError(f"{path}: entries {bad[:5]} are not runs (objects with attention and seed); "
                         "fix or remove them")
    return entries


def merge_results(path: Path, new: Sequence[dict]) -> list[dict]:
    """Merge ``new`` into the result list at ``path``: an entry replaces the one with the same
    ``(recipe, attention, seed)``, all others are kept; sorted by that key. An exclusive lock on
    ``<path>.lock`` lets several grids (e.g. one per GPU) share one results file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        entries = read_results(path)
        merged = {result_key(entry): entry for entry in entries}
        merged.update({result_key(entry): entry for entry in new})
        ordered = sorted(merged.values(),
                         key=lambda e: (str(e.get("recipe")), e["attention"], e["seed"]))
        write_json(path, ordered)
    return ordered


def metric_of(entry: dict) -> str:
    """The metric a result entry records (``val_<metric>``, ``test_<metric>``); ``mae`` for
    entries written before results named their task."""
    return get_task(entry.get("task", "regression")).metric_name


# --------------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------------
def mean_std(values: Sequence[float]) -> str:
    if not values:
        return "—"
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"


def _signed(value: float) -> str:
    return f"{value:+.4f}"


def recipe_table(entries: Sequence[dict]) -> list[str]:
    """Markdown lines for one recipe's runs: per-arm mean ± sample std, and per-seed paired
    differences ``arm - rpe`` of the task's metric (MAE for regression)."""
    task = get_task(entries[0].get("task", "regression"))
    name, val, test = task.metric_name.upper(), f"val_{task.metric_name}", f"test_{task.metric_name}"
    better = "higher" if task.maximize else "lower"
    arms = sorted({e["attention"] for e in entries}, key=lambda a: (a != "urpe", a != BASELINE, a))
    by_arm = {arm: {e["seed"]: e for e in entries if e["attention"] == arm} for arm in arms}
    lines = [f"| attention | runs | seeds | steps | val {name} | test {name} | wall (min, mean) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for arm in arms:
        runs = list(by_arm[arm].values())
        steps = sorted({e["steps"] for e in runs})
        lines.append(
            f"| {arm} | {len(runs)} | {', '.join(str(s) for s in sorted(by_arm[arm]))} "
            f"| {', '.join(f'{s:,}' for s in steps)} | {mean_std([e[val] for e in runs])} "
            f"| {mean_std([e[test] for e in runs])} "
            f"| {statistics.mean(e['wall_s'] for e in runs) / 60:.1f} |")
    for arm in arms:
        if arm == BASELINE or BASELINE not in by_arm:
            continue
        seeds = sorted(set(by_arm[arm]) & set(by_arm[BASELINE]))
        if not seeds:
            continue
        sign = "positive" if task.maximize else "negative"
        lines += ["", f"Paired by seed, {arm} − {BASELINE} ({sign}: {arm} has the {better} {name}):", "",
                  f"| seed | val {name} diff | test {name} diff |", "| --- | --- | --- |"]
        diffs = {m: [by_arm[arm][s][m] - by_arm[BASELINE][s][m] for s in seeds] for m in (val, test)}
        for i, seed in enumerate(seeds):
            lines.append(f"| {seed} | {_signed(diffs[val][i])} | {_signed(diffs[test][i])} |")
        summary = {m: (_signed(statistics.mean(v)) + (f" ± {statistics.stdev(v):.4f}" if len(v) > 1 else ""))
                   for m, v in diffs.items()}
        wins = sum((d > 0) if task.maximize else (d < 0) for d in diffs[test])
        lines.append(f"| mean ± std | {summary[val]} | {summary[test]} |")
        lines += ["", f"{arm} has the {better} test {name} in {wins} of {len(seeds)} seeds."]
    return lines


def format_table(entries: Sequence[dict]) -> str:
    """The whole table: one section per recipe, with the device and commits that ran it."""
    out = ["<!-- written by graphormer-urpe-ablation; do not edit -->"]
    for recipe in sorted({str(e.get("recipe")) for e in entries}):
        runs = [e for e in entries if str(e.get("recipe")) == recipe]
        commits = sorted({c for e in runs for c in ([e["commit"]] if isinstance(e["commit"], str)
                                                     else e["commit"])})
        out += ["", f"### `{recipe}`", "",
                f"Recipe: `{runs[0].get('budget', '')}`  ",
                f"Device: {'; '.join(sorted({e['device'] for e in runs}))}  ",
                f"Commit: {', '.join(commits)}", "", *recipe_table(runs)]
    return "\n".join(out) + "\n"


def write_table(results: Path, table: Path) -> str:
    text = format_table(read_json(results, []))
    with atomic_write(table) as handle:
        handle.write(text)
    return text


def readme_block(readme: Path, name: str, kind: str = "ablation") -> tuple[str, str, str, str]:
    """``(before, begin marker, end marker, after)`` of recipe ``name``'s block in ``readme``;
    ValueError unless it has one line ``<!-- KIND:NAME -->`` and, after it, one line
    ``<!-- /KIND:NAME -->`` (``kind``: ``ablation`` for the results, ``ablation-progress``)."""
    begin, end = f"<!-- {kind}:{name} -->", f"<!-- /{kind}:{name} -->"
    text = readme.read_text() if readme.is_file() else ""
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise ValueError(f"{readme} needs one line {begin} and, after it, one line {end} "
                         "where the table belongs")
    head, rest = text.split(begin, 1)
    return head, begin, end, rest.split(end, 1)[1]


def _write_block(readme: Path, name: str, kind: str, text: str) -> None:
    head, begin, end, tail = readme_block(readme, name, kind)
    with atomic_write(readme) as handle:
        handle.write(f"{head}{begin}\n{text.strip()}\n{end}{tail}")


def write_readme_block(readme: Path, name: str, entries: Sequence[dict]) -> None:
    """Replace what stands between the markers of :func:`readme_block` with recipe ``name``'s
    table (:func:`format_table`)."""
    _write_block(readme, name, "ablation", format_table([e for e in entries if e.get("recipe") == name]))


def _value(value: float | None) -> str:
    return "—" if value is None else f"{value:.4f}"


def format_progress(runs: Sequence[dict], max_steps: int) -> str:
    """The progress table of a grid's runs (``Run.progress`` entries): steps done of the recipe's
    ``max_steps``, best and latest validation metric, device time, steps per second of the fits'
    time, and the devices."""
    metric = next((r["metric"] for r in runs if r.get("metric")), "mae").upper()
    total = f"{max_steps:,}" if max_steps > 0 else "?"
    lines = [f"<!-- written by graphormer-urpe-ablation on {now()[:10]}; do not edit -->", "",
             f"| run | steps of {total} | best val {metric} | latest val {metric} | device time (min) "
             "| steps/s | device |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for run in runs:
        done = " (done)" if run["done"] else ""
        rate = "—" if run["steps_per_s"] is None else f"{run['steps_per_s']:.1f}"
        lines.append(f"| {run['run']} | {run['steps']:,}{done} | {_value(run['best'])} "
                     f"| {_value(run['latest'])} | {run['wall_s'] / 60:.1f} | {rate} "
                     f"| {'; '.join(run['devices']) or '—'} |")
    return "\n".join(lines)


def write_progress_block(readme: Path, name: str, runs: Sequence[dict], max_steps: int) -> None:
    """Replace recipe ``name``'s ``ablation-progress`` block (:func:`readme_block`) with
    :func:`format_progress`."""
    _write_block(readme, name, "ablation-progress", format_progress(runs, max_steps))

"""The ablation's results (``graphormer-urpe-ablation``): one JSON list of finished runs, merged
under a lock, and the markdown tables and README blocks written from it.
"""
from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import subprocess
from pathlib import Path
from typing import Any, Callable, Sequence

import filelock

from graphormer_urpe.utils.files import atomic_write
from graphormer_urpe.data.task import get_task
from graphormer_urpe.training.studies.study import now, update_block

#: The arm every other arm is compared with, seed by seed (plain Graphormer).
BASELINE = "rpe"
#: The results file of a runs directory, where ``--results`` is not given.
RESULTS_FILE = "results.json"


def code_commit() -> str:
    """HEAD of this package's checkout (``+dirty``: changed tracked files), ``unknown`` outside git."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(Path(__file__).resolve().parents[3]), *args], capture_output=True,
                              text=True, check=True).stdout.strip()

    try:
        head, dirty = git("rev-parse", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def describe_device(threads_per_job: int | None) -> str:
    """What a run trains on, in words: the GPU name, or the CPU model, cores and threads."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError, StopIteration):
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    threads = f"{threads_per_job} thread(s)" if threads_per_job else "default threads"
    return f"CPU {cpu} ({os.cpu_count()} cores), {threads}"


def _is_number(value: Any, count: bool = False) -> bool:
    """A JSON number (``count``: an integer >= 0), not a boolean."""
    ok = isinstance(value, int if count else (int, float)) and not isinstance(value, bool)
    return ok and (not count or value >= 0)


def entry_problem(entry: Any) -> str | None:
    """What keeps ``entry`` from being a run's result, in words; None for a result."""
    if not isinstance(entry, dict):
        return f"a JSON {type(entry).__name__}, not an object"
    try:
        metric = get_task(entry.get("task", "regression")).metric_name
    except (ValueError, TypeError):
        return f"unknown task {entry.get('task')!r}"
    get, commit = entry.get, entry.get("commit")
    valid = {"attention": isinstance(get("attention"), str), "seed": _is_number(get("seed"), True),
             "steps": _is_number(get("steps"), True), "wall_s": _is_number(get("wall_s")),
             "device": isinstance(get("device"), str),
             "commit": isinstance(commit, str) or isinstance(commit, list) and all(isinstance(c, str) for c in commit),
             f"val_{metric}": _is_number(get(f"val_{metric}")), f"test_{metric}": _is_number(get(f"test_{metric}"))}
    wrong = [name for name, ok in valid.items() if not ok]
    return f"missing or wrong {', '.join(wrong)}" if wrong else None


def read_results(path: Path) -> list[dict]:
    """The result list at ``path`` (empty when missing); ``ValueError`` unless a list of runs."""
    try:
        entries = json.loads(path.read_text(encoding="utf-8")) if path.exists() else []
    except (ValueError, OSError) as error:  # not JSON, not UTF-8, a directory, no permission
        raise ValueError(f"{path}: not a readable JSON file ({error}); fix or remove it") from None
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a JSON list of runs, found {type(entries).__name__}; "
                         "fix or remove it")
    for index, entry in enumerate(entries):
        problem = entry_problem(entry)
        if problem:
            raise ValueError(f"{path}: entry {index} is not a run ({problem}); fix or remove it")
    return entries


def publish_results(path: Path, table: Path, new: Sequence[dict]) -> str:
    """``new`` merged into the result list at ``path`` (by recipe, attention, seed) and its table
    written, under one lock shared by grids of one results file; the table."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(path.with_name(path.name + ".lock")):
        entries = read_results(path)
        merged = {(entry.get("recipe"), entry["attention"], entry["seed"]): entry for entry in [*entries, *new]}
        ordered = sorted(merged.values(), key=lambda e: (str(e.get("recipe")), e["attention"], e["seed"]))
        if ordered != entries:
            with atomic_write(path) as handle:
                handle.write(json.dumps(ordered, indent=1) + "\n")
        return write_table(path, table)


def metric_of(entry: dict) -> str:
    """The metric a result entry records (``val_<metric>``; no task: ``mae``)."""
    return get_task(entry.get("task", "regression")).metric_name


def best_run(entries: Sequence[dict], arm: str = "urpe") -> dict | None:
    """``arm``'s result with the best validation metric (the figure's run); None without one."""
    runs = [entry for entry in entries if entry["attention"] == arm]
    if not runs:
        return None
    best = max if get_task(runs[0].get("task", "regression")).maximize else min
    return best(runs, key=lambda entry: entry[f"val_{metric_of(entry)}"])


def figure_path(figures: Path, recipe: str) -> Path:
    """The file of recipe ``recipe``'s figure of learned tables in the folder ``figures``."""
    return figures / f"{recipe}-tables.png"


def mean_std(values: Sequence[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:.4f}" if values else "—"
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"


def _signed(value: float) -> str:
    return f"{value:+.4f}"


def recipe_table(entries: Sequence[dict]) -> list[str]:
    """One recipe's table: per arm mean ± sample std, per seed the paired ``arm - rpe``."""
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
    """The table of the result list at ``results`` written to ``table``; the table."""
    text = format_table(read_results(results))
    with atomic_write(table) as handle:
        handle.write(text)
    return text


def readme_markers(name: str, kind: str = "ablation") -> tuple[str, str]:
    """The lines around recipe ``name``'s ``kind`` block of a README (:func:`.study.page_block`)."""
    return f"<!-- {kind}:{name} -->", f"<!-- /{kind}:{name} -->"


def write_readme_block(readme: Path, name: str, results: Path) -> None:
    """Recipe ``name``'s result table into its ``ablation`` block of ``readme``."""
    update_block(readme, *readme_markers(name), lambda: format_table(
        [e for e in read_results(results) if e.get("recipe") == name]))


def _value(value: float | None) -> str:
    return "—" if value is None else f"{value:.4f}"


def format_progress(runs: Sequence[dict], max_steps: int) -> str:
    """The progress table of a grid's runs (:meth:`.ablation.Grid.progress`)."""
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


def write_progress_block(readme: Path, name: str, runs: Callable[[], Sequence[dict]], max_steps: int) -> None:
    """Recipe ``name``'s ``ablation-progress`` block: :func:`format_progress` of ``runs()``."""
    update_block(readme, *readme_markers(name, "ablation-progress"), lambda: format_progress(runs(), max_steps))

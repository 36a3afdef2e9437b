"""scripts/bench_train.py on CPU, real ZINC: the exact benchmark command that docs/gpu.md gives
for a GPU runs here in one step per row, with shrunken sizes; a failing row is recorded and the
next one still runs."""
from __future__ import annotations

import importlib.util
import json
import shlex
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
#: Appended to the GPU command: the CPU, one timed step, and sizes that run in seconds.
ON_CPU = ["--device", "cpu", "--warmup", "1", "--steps", "1", "--count-ops", "1", "--zinc-batch", "16",
          "--width", "8"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def load_bench_train(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_train", REPO / "scripts" / "bench_train.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_train", module)  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


def gpu_benchmark_command() -> list[str]:
    """The benchmark command of docs/gpu.md's "The first command on a GPU", as arguments."""
    text = (REPO / "docs" / "gpu.md").read_text()
    section = text[text.index("## The first command on a GPU"):]
    line = next(line for line in section.splitlines() if line.startswith("python3 scripts/bench_train.py"))
    return shlex.split(line)[2:]


def test_the_gpu_benchmark_command_runs_on_cpu(zinc_data_root, monkeypatch, capsys):
    """Every row of the GPU command: eager, the engine and the engine with the Triton core (its
    eager fallback on CPU), URPE and RPE, at the recipe's 20 hops; each row counts its
    kernel-launching operators and lists its costliest operators and the bytes they move."""
    bench = load_bench_train(monkeypatch)
    argv = gpu_benchmark_command()
    assert argv[argv.index("--zinc-batch") + 1] == "256"
    assert bench.main([*argv, *ON_CPU, "--zinc-root", str(zinc_data_root)]) == 0
    out = capsys.readouterr().out
    results = json.loads(out.strip().splitlines()[-1])
    rows = {(row["path"], row["attention"]): row for row in results["training"]}
    # Where each row's time goes: its costliest operators, most first, printed and in the JSON.
    for row in rows.values():
        times = [op["ms_per_step"] for op in row["top_ops"]]
        assert len(times) == bench.TOP_OPS and times == sorted(times, reverse=True) and times[0] > 0
        assert all(op["name"].startswith("aten::") and op["calls_per_step"] > 0 for op in row["top_ops"])
        # ... and all of them together: at least the listed ones, in more calls.
        total = row["device_total"]
        assert total["ms_per_step"] >= sum(times) - 1e-3 and total["calls_per_step"] > len(times)
    assert out.count("where the time goes") == len(rows)
    paths = argv[argv.index("--paths") + 1].split(",")
    assert "engine" in paths and set(rows) == {(path, attention) for path in paths for attention in ("urpe", "rpe")}
    assert all("error" not in row and row["ms_per_step"] > 0 and row["max_hops"] == 20 for row in rows.values())
    assert all(row["ops_per_step"] > 0 for row in rows.values())
    # The bytes each step's operators move: URPE's C adds to RPE's, at least a read and a write
    # of the batch's [B, H, N+1, N+1] attention per layer.
    for path in ("eager", "engine"):
        urpe, rpe = (rows[path, attention]["traffic_mb_per_step"] for attention in ("urpe", "rpe"))
        assert 0 < rpe < urpe and f"{urpe:.0f} MB/step" in out


def test_a_failing_row_is_recorded_and_the_next_runs(zinc_data_root, monkeypatch, capsys):
    bench = load_bench_train(monkeypatch)
    run_training = bench.run_training

    def eager_fails(name, attention, path, args):
        if path == "eager":
            raise RuntimeError("boom\nsecond line")
        return run_training(name, attention, path, args)

    monkeypatch.setattr(bench, "run_training", eager_fails)
    assert bench.main(["--device", "cpu", "--presets", "zinc", "--attention", "urpe",
                       "--paths", "eager,engine,resident@32-true", "--warmup", "1", "--steps", "2",
                       "--zinc-batch", "8", "--zinc-hops", "5", "--skip-data-only",
                       "--zinc-root", str(zinc_data_root)]) == 0
    out = capsys.readouterr().out
    rows = json.loads(out.strip().splitlines()[-1])["training"]
    assert [row["path"] for row in rows] == ["eager", "engine", "resident@32-true"]
    assert rows[0]["error"] == "RuntimeError: boom"
    assert "failed: RuntimeError: boom" in out
    engine = rows[1]
    assert engine["static_shapes"] and engine["matmul_precision"] == "high"
    assert engine["attention_impl"] == "eager" and engine["precision"] == "32-true" and engine["ms_per_step"] > 0
    assert engine["max_hops"] == 5
    assert rows[2]["ms_per_step"] > 0 and not rows[2]["compile"] and "compiled_graphs" not in rows[2]
    assert torch.get_float32_matmul_precision() == "highest"  # restored after the row

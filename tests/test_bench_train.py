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
          "--width", "8", "--ensemble-backbone", json.dumps({"hidden_dim": 8, "ffn_dim": 8})]

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
    eager fallback on CPU), URPE and RPE, at the recipe's 20 hops; the engine's step (as a GPU
    records it) has fewer kernel-launching operators than the eager step; each row lists its
    costliest operators and the bytes its operators move; the ensemble of 1 and
    6 members gathers its batches as it goes, and 6 stacked members launch far fewer kernels than
    6 runs."""
    bench = load_bench_train(monkeypatch)
    argv = gpu_benchmark_command()
    assert "--ensemble" in argv and argv[argv.index("--zinc-batch") + 1] == "256"
    # --ensemble-args reaches every member: the stacked module sets the members' matmul precision.
    precisions = []
    monkeypatch.setattr(torch, "set_float32_matmul_precision", precisions.append)
    assert bench.main([*argv, *ON_CPU, "--zinc-root", str(zinc_data_root),
                       "--ensemble-args", "--model.matmul_precision medium"]) == 0
    assert "medium" in precisions
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
    assert out.count("where the time goes") == len(rows) + len(results["ensemble"])
    assert set(rows) == {(path, attention) for path in ("eager", "engine", "engine-triton")
                         for attention in ("urpe", "rpe")}
    assert all("error" not in row and row["ms_per_step"] > 0 and row["max_hops"] == 20 for row in rows.values())
    for attention in ("urpe", "rpe"):
        assert 0 < rows["engine", attention]["ops_per_step"] < 0.8 * rows["eager", attention]["ops_per_step"]
    # The bytes each step's operators move: URPE's C adds to RPE's, at least a read and a write
    # of the batch's [B, H, N+1, N+1] attention per layer.
    for path in ("eager", "engine"):
        urpe, rpe = (rows[path, attention]["traffic_mb_per_step"] for attention in ("urpe", "rpe"))
        assert 0 < rpe < urpe and f"{urpe:.0f} MB/step" in out
    ensemble = results["ensemble"]
    assert [(row["members"], row["captured"]) for row in ensemble] == [(6, False), (1, False)]  # the ablation's first
    assert all(row["member_args"] == "--model.matmul_precision medium" and not row["in_turn"] for row in ensemble)
    assert all(row["ms_per_step"] > 0 and row["gather_ms_per_step"] > 0 and row["max_hops"] == 20
               and row["loop_ms_per_step"] > 0 and row["loop_member_steps_per_s"] > 0 for row in ensemble)
    six, one = ensemble
    assert one["kernel_ops_per_step"] < six["kernel_ops_per_step"] < 2 * one["kernel_ops_per_step"]
    # Six stacked members move six times one member's bytes: the stacking (vmap over members)
    # adds no copy of its own.
    assert 5.9 * one["traffic_mb_per_step"] < six["traffic_mb_per_step"] < 6.1 * one["traffic_mb_per_step"]
    # Where the stacked step's time goes, as for the single runs: more of it for six members.
    assert all(len(row["top_ops"]) == bench.TOP_OPS for row in ensemble)
    assert 0 < one["device_total"]["ms_per_step"] < six["device_total"]["ms_per_step"]


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
    assert engine["engine"] and engine["static_shapes"] and engine["matmul_precision"] == "high"
    assert engine["attention_impl"] == "eager" and engine["precision"] == "32-true" and engine["ms_per_step"] > 0
    assert engine["max_hops"] == 5
    assert rows[2]["ms_per_step"] > 0 and not rows[2]["compile"] and "compiled_graphs" not in rows[2]
    assert torch.get_float32_matmul_precision() == "highest"  # restored after the row


def test_the_fused_attention_ensemble_needs_the_members_in_turn(monkeypatch, capsys):
    bench = load_bench_train(monkeypatch)
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--ensemble", "6", "--ensemble-attention-impl", "triton"])
    assert ("--ensemble-attention-impl triton needs --ensemble-in-turn (vmap cannot batch the fused kernels)"
            in capsys.readouterr().err)

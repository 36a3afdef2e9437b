"""scripts/bench_attention.py on CPU, real ZINC: the GPU command of docs/gpu.md times the eager
core here and says why the fused rows wait for a GPU; under Triton's CPU interpreter each fused
launch configuration is checked against the eager core."""
from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "bench_attention.py"
SMALL = ["--device", "cpu", "--batch", "2", "--batches", "1", "--reps", "1", "--warmup", "0"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def gpu_command() -> list[str]:
    text = (REPO / "docs" / "gpu.md").read_text()
    line = next(line for line in text.splitlines() if line.startswith("python3 scripts/bench_attention.py"))
    return shlex.split(line)[2:]


def load_bench_attention():
    """scripts/bench_attention.py as a module (its main() runs in this process)."""
    spec = importlib.util.spec_from_file_location("bench_attention", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_the_gpu_command_times_the_eager_core_on_cpu(zinc_data_root, capsys):
    bench = load_bench_attention()
    argv = [*gpu_command(), *SMALL, "--zinc-root", str(zinc_data_root)]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    rows = result["rows"]
    assert result["tokens"] == 38 and result["batch"] == 2  # the training split's largest graph + the token
    assert rows[0]["name"] == "eager" and rows[0]["ms"] > 0
    assert [row["name"] for row in rows[2:]] == list(bench.DEFAULT_CONFIGS)
    for row in rows[1:]:
        assert "ms" not in row and "run on CUDA" in row["skipped"], row


def test_each_launch_configuration_computes_the_eager_core_under_the_interpreter(zinc_data_root, tmp_path):
    pytest.importorskip("triton")
    configs = ["fwd=64x64w4,dkdv=16x64w2,dq=32x64w4s1"]
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *SMALL, "--batch", "1", "--zinc-root", str(zinc_data_root),
         "--configs", *configs],
        env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(result.stdout.strip().splitlines()[-1])["rows"]
    assert [row["name"] for row in rows] == ["eager", "fused default", *configs]
    for row in rows[1:]:
        assert "error" not in row and "ms" not in row and row["skipped"].startswith("checked, not timed"), row
        assert row["max_diff"] < 1e-4, row  # no TF32 on CPU: float32 sums in another order


def test_a_configuration_that_cannot_be_read_is_named_before_the_data_loads(tmp_path, capsys):
    bench = load_bench_attention()
    with pytest.raises(SystemExit) as stopped:
        bench.main([*SMALL, "--zinc-root", str(tmp_path / "none"), "--configs", "fwd=16by64"])
    assert str(stopped.value) == "--configs: cannot read 'fwd=16by64' (expected e.g. fwd=16x64w2 or dq=32x32w4s1)"
    assert not (tmp_path / "none").exists() and capsys.readouterr().out == ""

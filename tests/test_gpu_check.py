"""scripts/gpu_check.sh's own logic (its parts need a GPU): each part's command runs with the
budget's share and its output lands in its file, a part that fails is recorded and the next one
runs, a budget that runs out skips the rest, and the summary names each part. A stand-in
interpreter (``PYTHON``) records the commands instead of running them."""
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

STUB = """#!/usr/bin/env bash
echo "$*" >> "{log}"
case "$*" in
  *load_zinc*) echo "train 10000 graphs"; exit 3 ;;
  *bench_train*) echo "  zinc/slim      urpe  engine  6.88 ms/step (warmup 1.2 s)" ;;
  *pytest*) echo "4 passed in 1.0s" ;;
  *) echo "torch 2.11.0" ;;
esac
"""


def run_check(tmp_path, seconds: int) -> tuple[subprocess.CompletedProcess, Path, list[str]]:
    log, stub, out = tmp_path / "calls.log", tmp_path / "python", tmp_path / "out"
    stub.write_text(STUB.format(log=log))
    stub.chmod(0o755)
    env = {**os.environ, "PYTHON": str(stub), "GPU_CHECK_SECONDS": str(seconds)}
    result = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), str(out)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=60)
    return result, out, log.read_text().splitlines() if log.exists() else []


def test_every_part_runs_and_a_failing_part_is_recorded(tmp_path):
    result, out, calls = run_check(tmp_path, 540)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["bench_ensemble.txt", "bench_ensemble_in_turn.txt",
                                                     "bench_ensemble_in_turn_triton.txt", "bench_train.txt",
                                                     "data.txt", "machine.txt", "tests.txt", "tests_fused.txt"]
    # The parts' shares fill the default budget without cutting one (each keeps 5 s in reserve).
    shares = [int(line.split("(at most ")[1].split()[0]) for line in result.stdout.splitlines()
              if "(at most " in line]
    assert len(shares) == 7 and sum(shares) + 5 * len(shares) <= 540
    # ZINC is built first, before anything is timed
    assert "load_zinc" in calls[1] and not any("bench_" in c for c in calls[:2])  # after the versions
    # The measurements at the recipe's shape, the ensemble compiled, then the GPU tests.
    assert any("bench_train.py" in c and "engine-compiled-triton" in c and "--zinc-batch 256" in c
               and "--count-ops 3" in c for c in calls)  # one command, its options all there
    ensembles = [c for c in calls if "--ensemble 6" in c and "--model.compile true" in c]
    assert len(ensembles) == 3 and "--ensemble-in-turn" not in ensembles[0]
    assert "--ensemble-in-turn" in ensembles[1] and "--ensemble-attention-impl" not in ensembles[1]
    assert "--ensemble-in-turn --ensemble-attention-impl triton" in ensembles[2]
    assert any("-m gpu tests" in c for c in calls)
    assert any("test_ensemble.py tests/training/test_engine.py -k kernel or fused_attention" in c for c in calls)
    assert "4 passed" in (out / "tests_fused.txt").read_text()
    assert "exit status 3" in (out / "data.txt").read_text()  # recorded; the next part ran
    assert "4 passed" in (out / "tests.txt").read_text()
    assert "6.88 ms/step" in result.stdout and "train 10000 graphs" in result.stdout
    assert "torch 2.11.0" in (out / "machine.txt").read_text()


def test_a_spent_budget_skips_the_remaining_parts(tmp_path):
    result, out, calls = run_check(tmp_path, 12)
    assert result.returncode == 0, result.stderr
    assert not any("bench_" in c or "pytest" in c for c in calls)
    for name in ("data", "bench_train", "bench_ensemble", "bench_ensemble_in_turn",
                 "bench_ensemble_in_turn_triton", "tests", "tests_fused"):
        assert (out / f"{name}.txt").read_text().startswith("skipped: the budget ran out")


def test_an_output_path_that_is_a_file_or_a_link_is_refused_before_anything_runs(tmp_path):
    (tmp_path / "target").mkdir()
    for name, make in (("file", lambda p: p.write_text("keep")), ("link", lambda p: p.symlink_to(tmp_path / "target"))):
        out = tmp_path / name
        make(out)
        result = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), str(out)], cwd=REPO,
                                env={**os.environ, "PYTHON": "/nonexistent"}, capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 2 and result.stderr.strip() == (
            f"gpu_check.sh: {out} is a link or not a directory; name a directory to write the results into")
    assert (tmp_path / "file").read_text() == "keep" and not any((tmp_path / "target").iterdir())

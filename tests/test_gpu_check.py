"""scripts/gpu_check.sh's own logic (its parts need a GPU): set-up, ZINC, the GPU tests and the
speed ranking only when the code differs from the ranking recorded for this GPU, then the
ablation with a time budget that leaves time to pack the runs' states into parts that come back;
a part that fails is recorded and the next one runs, a budget that runs out skips the rest. A
stand-in interpreter (``PYTHON``) records the commands instead of running them, names a GPU when
asked for one, and writes the ranking where the benchmark would. Without a GPU, or into a folder
of other files, it stops at once in one line."""
import io
import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

STUB = """#!/usr/bin/env bash
echo "$*" >> "{log}"
case "$*" in
  *load_zinc*) echo "train 10000 graphs"; exit 3 ;;
  *bench_train*)
    record=$(echo "$*" | sed 's/.*--record \\([^ ]*\\).*/\\1/'); code=$(echo "$*" | sed 's/.*--code \\([^ ]*\\).*/\\1/')
    mkdir -p "$(dirname "$record")"; echo "{{\\"code\\": \\"$code\\"}}" > "$record"
    echo "fastest: engine-compiled (urpe), 6.88 ms/step" ;;
  *graphormer_urpe.cli.ablation*) mkdir -p "{runs}/zinc-paper/urpe-s0"; echo state > "{runs}/zinc-paper/urpe-s0/last.ckpt"
    echo "urpe-s0: fit for 300 s" ;;
  *pytest*) echo "4 passed in 1.0s" ;;
  *get_device_name*) echo "cuda device: {gpu}"; echo "torch 2.11.0 built for CUDA 13.0" ;;
  *) echo "torch 2.11.0" ;;
esac
"""


def run_check(tmp_path, seconds: int, stand_in: str = STUB,
              gpu: str = "NVIDIA H200") -> tuple[subprocess.CompletedProcess, Path, list[str]]:
    log, stub, out = tmp_path / "calls.log", tmp_path / "python", tmp_path / "out"
    stub.write_text(stand_in.format(log=log, runs=tmp_path / "runs", gpu=gpu))
    stub.chmod(0o755)
    log.unlink(missing_ok=True)
    env = {**os.environ, "PYTHON": str(stub), "GPU_CHECK_SECONDS": str(seconds), "RUNS_DIR": str(tmp_path / "runs"),
           "RESULTS_DIR": str(tmp_path / "results"), "README": str(tmp_path / "README.md")}
    (tmp_path / "README.md").write_text("readme\n")
    result = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), str(out)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=60)
    return result, out, log.read_text().splitlines() if log.exists() else []


def test_ranks_once_per_code_then_only_trains_and_packs_the_state(tmp_path):
    result, out, calls = run_check(tmp_path, 570)
    assert result.returncode == 0, result.stderr
    zinc = next(i for i, c in enumerate(calls) if "load_zinc" in c)
    assert any("setup.py -q build_ext --inplace" in c for c in calls[:zinc])
    assert not any("bench_" in c for c in calls[:zinc])  # ZINC first
    assert "exit status 3" in (out / "data.txt").read_text()  # recorded; the next part ran
    assert any("-m gpu tests" in c for c in calls) and "4 passed" in (out / "tests.txt").read_text()
    [bench] = [c for c in calls if "bench_train.py" in c]
    assert "--zinc-batch 256" in bench and "engine-compiled@bf16-mixed" in bench and "--count-ops 3" in bench
    [ablation] = [c for c in calls if "graphormer_urpe.cli.ablation" in c]
    assert "--config configs/zinc.yaml --name zinc-paper" in ablation and "--model.compile true" in ablation
    assert f"--readme {tmp_path / 'README.md'}" in ablation
    budget = int(ablation.split("--time-budget ")[1].split("s ")[0])
    assert 200 < budget <= 570 - 60  # the rest of the budget, less the reserve for packing
    assert "6.88 ms/step" in result.stdout and "train 10000 graphs" in result.stdout
    parts = sorted(out.glob("state.tgz.part-*"))
    assert parts and all(p.stat().st_size <= 15 * 2**20 for p in parts)
    with tarfile.open(fileobj=open(parts[0], "rb"), mode="r:gz") as packed:
        names = packed.getnames()
    assert any(n.endswith("zinc-paper/urpe-s0/last.ckpt") for n in names)
    assert any(n.endswith("README.md") for n in names) and any(n.endswith("ablation.txt") for n in names)
    recorded = json.loads(next((tmp_path / "results").glob("ranking_*.json")).read_text())

    # Again with the same code, into the same folder: the ranking recorded for this GPU stands;
    # only training; the packed state is this run's alone.
    (out / "state.tgz.part-zz").write_bytes(b"stale")
    result, out, calls = run_check(tmp_path, 570)
    assert result.returncode == 0, result.stderr
    assert not any("bench_train.py" in c or "-m pytest" in c for c in calls)
    assert any("graphormer_urpe.cli.ablation" in c for c in calls)
    packed = b"".join(p.read_bytes() for p in sorted(out.glob("state.tgz.part-*")))
    with tarfile.open(fileobj=io.BytesIO(packed), mode="r:gz") as whole:
        assert any(n.endswith("zinc-paper/urpe-s0/last.ckpt") for n in whole.getnames())
    assert (out / "ranking.txt").read_text().startswith("ranking of this code on this GPU")
    assert recorded["code"]


def test_a_ranking_whose_gpu_tests_failed_is_not_recorded(tmp_path):
    failing = STUB.replace('*pytest*) echo "4 passed in 1.0s" ;;', '*pytest*) echo "1 failed, 3 passed in 1.0s"; exit 1 ;;')
    assert failing != STUB
    result, out, calls = run_check(tmp_path, 570, failing)
    assert result.returncode == 0, result.stderr
    assert any("bench_train.py" in c for c in calls) and (out / "ranking.json").exists()
    assert not (tmp_path / "results").exists() or not list((tmp_path / "results").glob("ranking_*.json"))


def test_a_spent_budget_skips_the_remaining_parts(tmp_path):
    result, out, calls = run_check(tmp_path, 12)
    assert result.returncode == 0, result.stderr
    assert not any("bench_train.py" in c or "-m pytest" in c or "graphormer_urpe.cli.ablation" in c for c in calls)
    for name in ("data", "ranking", "tests", "ablation"):
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


def test_a_folder_of_other_files_is_refused_before_anything_runs(tmp_path):
    """An OUT_DIR holding the user's own ``setup.txt`` and ``data.txt`` (names the parts write):
    one line, exit status 2, nothing run, the files as they were. A folder the script wrote
    before (marked ``.gpu_check``) is written into again (the test above)."""
    out = tmp_path / "out"
    out.mkdir()
    mine = {"setup.txt": "my notes\n", "data.txt": "my data\n"}
    for name, text in mine.items():
        (out / name).write_text(text)
    result, _, calls = run_check(tmp_path, 570)
    assert result.returncode == 2 and calls == [], result.stderr
    assert result.stderr.strip() == (f"gpu_check.sh: {out} holds files that gpu_check.sh did not write (data.txt "
                                     "setup.txt...), which it would overwrite; name an empty or new directory")
    assert {p.name: p.read_text() for p in out.iterdir()} == mine


def test_without_a_gpu_it_stops_at_once_and_writes_nothing(tmp_path):
    """The stand-in's torch sees no CUDA device: one line, exit status 1, only the probe ran,
    no OUT_DIR (so no state part that the next machine would take for a trained slice)."""
    result, out, calls = run_check(tmp_path, 570, gpu="")
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"gpu_check.sh: no CUDA GPU visible to {tmp_path / 'python'} (torch 2.11.0 built for CUDA 13.0 sees no "
        "CUDA device); nothing run, nothing written"]
    assert len(calls) == 1 and "get_device_name" in calls[0] and not out.exists()


def test_without_a_gpu_the_real_interpreter_stops_at_once(tmp_path):
    """The same with this interpreter's own torch, where it sees no CUDA device; and with an
    interpreter that has no torch."""
    import sys

    import torch

    if torch.cuda.is_available():
        pytest.skip("torch sees a CUDA device here")
    for python, why in ((sys.executable, f"torch {torch.__version__} built for CUDA {torch.version.cuda} "
                                         "sees no CUDA device"),
                        ("/nonexistent/python", "/nonexistent/python: No such file or directory")):
        out = tmp_path / "out"
        result = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), str(out)], cwd=REPO,
                                env={**os.environ, "PYTHON": python}, capture_output=True, text=True, timeout=120)
        assert result.returncode == 1, result.stderr
        [line] = result.stderr.strip().splitlines()
        assert line.startswith(f"gpu_check.sh: no CUDA GPU visible to {python} (") and why in line, line
        assert line.endswith("); nothing run, nothing written") and not out.exists()

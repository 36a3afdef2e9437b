"""The ablation runner through its command on the real ZINC-12k (tiny budget): a killed grid
resumes from last.ckpt, finished runs are not redone, results merge into the JSON list, and the
table holds the per-arm means and the paired differences."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from graphormer_urpe.cli.ablation import main
from graphormer_urpe.training.studies.ablation import backbone_overrides
from graphormer_urpe.training.studies.ablation_results import format_table, publish_results, read_results
from graphormer_urpe.prediction.load import best_checkpoint

REPO = Path(__file__).resolve().parents[1]
TINY_BACKBONE = {"num_layers": 2, "hidden_dim": 16, "ffn_dim": 16, "num_heads": 2}
STEPS = 16  # 8 epochs of 2 batches, each validated: long enough to be killed part-way


def runner_command(tmp_path: Path, data_root: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "graphormer_urpe.cli.ablation",
        "--config", str(REPO / "configs" / "zinc.yaml"), "--name", "tiny",
        "--arms", "urpe", "rpe", "--seeds", "0",
        "--runs-dir", str(tmp_path / "runs"), "--results", str(tmp_path / "results.json"),
        "--threads-per-job", "1",
        "--trainer.precision", "32-true", "--trainer.max_steps", str(STEPS),
        "--trainer.check_val_every_n_epoch", "1", "--data.init_args.max_hops", "5",
        "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "2",
        "--trainer.limit_test_batches", "2", "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false", "--trainer.log_every_n_steps", "1",
        "--model.backbone", json.dumps(TINY_BACKBONE), "--model.warmup_steps", "4",
        "--model.total_steps", str(STEPS), "--data.init_args.root", str(data_root),
        "--data.init_args.batch_size", "16", *extra,
    ]


def signal_once_written(command: list[str], path: Path, env: dict, signum: int) -> tuple[int, str]:
    """Start the runner, send its whole process group ``signum`` as soon as ``path`` exists, and
    wait for it to end: its exit status and output."""
    grid = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 300
    while not path.exists() and grid.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(grid.pid, signum)
    output = grid.communicate(timeout=300)[0].decode()
    assert path.exists(), output[-3000:]
    return grid.returncode, output


def run_trials(tmp_path: Path, arm: str, seed: int = 0) -> list:
    """The study's trials of run ``<arm>-s<seed>`` of the test grid, in order."""
    import optuna

    study = optuna.load_study(study_name="tiny", storage=f"sqlite:///{tmp_path / 'runs' / 'tiny' / 'study.db'}")
    return [t for t in study.trials if t.params == {"arm": arm, "seed": seed}]


@pytest.mark.slow
def test_killed_grid_resumes_merges_results_and_writes_the_table(zinc_data_root, tmp_path, capsys,
                                                                  monkeypatch):
    results = tmp_path / "results.json"
    other = {"recipe": "other", "attention": "urpe", "seed": 0, "steps": 1, "val_mae": 1.0,
             "test_mae": 1.0, "wall_s": 1.0, "device": "x", "commit": "c"}
    results.write_text(json.dumps([other]))
    command = runner_command(tmp_path, zinc_data_root)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    # Kill the whole grid as soon as the first run has a last.ckpt.
    last = tmp_path / "runs" / "tiny" / "urpe-s0" / "checkpoints" / "last.ckpt"
    signal_once_written(command, last, env, signal.SIGKILL)
    [killed] = run_trials(tmp_path, "urpe")
    assert killed.state.name == "RUNNING" and "result" not in killed.user_attrs
    steps_at_kill = torch.load(last, map_location="cpu", weights_only=False)["global_step"]
    assert 0 < steps_at_kill < STEPS

    # Run again: the killed run resumes, the other one runs, both are tested.
    finished = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    assert f"urpe-s0: fit (resuming from last.ckpt at step {steps_at_kill})" in finished.stdout
    urpe = run_trials(tmp_path, "urpe")  # the killed trial failed (its runner is gone), the next one complete
    assert [t.state.name for t in urpe] == ["FAIL", "COMPLETE"] and "fit_status" not in urpe[0].user_attrs
    assert urpe[1].user_attrs["fit_status"] == 0 and urpe[1].user_attrs["steps"] == [steps_at_kill, STEPS]
    assert "Restoring states from the checkpoint path" in (last.parents[1] / "fit.log").read_text()
    args = urpe[1].user_attrs["args"]  # the arm's backbone comes last and keeps the recipe's sizes
    last_backbone = len(args) - 1 - args[::-1].index("--model.backbone")
    recipe = yaml.safe_load((REPO / "configs" / "zinc.yaml").read_text())["model"]["backbone"]
    assert json.loads(args[last_backbone + 1]) == {**recipe, **TINY_BACKBONE, "attention": "urpe",
                                                   "share_urpe_scale": False}

    entries = read_results(results)
    assert other in entries and len(entries) == 3
    runs = {e["attention"]: e for e in entries if e["recipe"] == "tiny"}
    assert set(runs) == {"urpe", "rpe"}
    for arm, entry in runs.items():
        assert entry["seed"] == 0 and entry["steps"] == STEPS and 0 < entry["best_step"] <= STEPS
        assert 0 < entry["val_mae"] < 10 and 0 < entry["test_mae"] < 10 and entry["wall_s"] > 0
        assert entry["commit"] and "CPU" in entry["device"]
        path, val_mae, best_step, _, _ = best_checkpoint(tmp_path / "runs" / "tiny" / f"{arm}-s0")
        assert (val_mae, best_step) == (pytest.approx(entry["val_mae"], abs=1e-6), entry["best_step"])
        best = torch.load(path, map_location="cpu", weights_only=False)
        scales = [k for k in best["state_dict"] if "urpe_scales" in k]
        assert bool(scales) == (arm == "urpe"), run_trials(tmp_path, arm)[-1].user_attrs["args"]
    # The best checkpoint is chosen on validation MAE: no logged val/mae is lower.
    metrics = (tmp_path / "runs" / "tiny" / "rpe-s0" / "csv").rglob("metrics.csv")
    logged = [float(v) for path in metrics for v in _column(path, "val/mae")]
    assert min(logged) == pytest.approx(runs["rpe"]["val_mae"], abs=1e-6)

    table = (tmp_path / "results.md").read_text()
    diff = runs["urpe"]["test_mae"] - runs["rpe"]["test_mae"]
    assert "### `tiny`" in table and "### `other`" in table
    assert f"| 0 | {runs['urpe']['val_mae'] - runs['rpe']['val_mae']:+.4f} | {diff:+.4f} |" in table

    # The learned tables of the best-validation URPE run next to RPE's B, from the results.
    figures = tmp_path / "figures"
    main(["--table-only", "--name", "tiny", "--runs-dir", str(tmp_path / "runs"),
          "--results", str(results), "--figures", str(figures)])
    png = figures / "tiny-tables.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000

    # A third invocation (in this process: no training to start) finds both runs finished and
    # runs nothing.
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the runner empties it for LightningCLI
    capsys.readouterr()
    main(command[3:])
    again = capsys.readouterr().out
    assert "tiny: 2 runs" in again and ": fit" not in again and ": test" not in again
    assert run_trials(tmp_path, "urpe") == urpe
    assert read_results(results) == entries


def test_one_runner_per_run_directory_and_steps_from_the_checkpoint(zinc_data_root, tmp_path,
                                                                   start_lock_holder, capsys, monkeypatch):
    """A second runner on the same runs stops at once (exit 2), naming the first one's pid; the
    first one's run ends at its max_steps (5: inside an epoch of 2 batches, after the validation
    at step 4), which its result reports from the checkpoint's global_step. The first runner is
    the command in a process of its own; the second and third run ``main()`` in this one."""
    command = runner_command(tmp_path, zinc_data_root, "--arms", "rpe", "--trainer.max_steps", "5",
                             "--model.total_steps", "5")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    lock = tmp_path / "runs" / "tiny" / "rpe-s0" / "ablation.lock"
    first = start_lock_holder(command, lock, cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT)
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the runner empties it for LightningCLI
    try:
        capsys.readouterr()
        with pytest.raises(SystemExit) as refused:
            main(command[3:])
        second = capsys.readouterr()
        assert first.poll() is None, "the first runner must still hold its runs"
        assert refused.value.code == 2, second.out[-3000:] + second.err[-3000:]
        errors = [line for line in second.err.splitlines() if "error" in line]
        assert errors == [f"graphormer-urpe-ablation: error: {lock.parent} is in use by another "
                          f"graphormer-urpe-ablation (pid {first.pid}); wait for it to end, or "
                          "choose another --name or --runs-dir"], second.err[-3000:]
        assert ": fit" not in second.out
        output, _ = first.communicate(timeout=600)
    finally:
        first.kill()
    assert first.returncode == 0, output[-3000:]
    [entry] = [e for e in read_results(tmp_path / "results.json") if e["recipe"] == "tiny"]
    assert entry["steps"] == 5 and entry["best_step"] in (2, 4)
    # the lock is the kernel's: the next runner (all done now) takes it and runs nothing
    main(command[3:])
    again = capsys.readouterr().out
    assert "tiny: 1 runs" in again and ": fit" not in again


@pytest.mark.slow
def sliced_and_uninterrupted(tmp_path: Path, cli_args: list[str], env: dict) -> tuple[dict, dict]:
    """The last.ckpt of the runner's urpe-s0 run, and that of the same fit (``cli_args``) run
    uninterrupted by the fit command (one thread, as the runner's --threads-per-job 1) into
    ``reference``."""
    root = cli_args.index("--trainer.default_root_dir")
    reference = [*cli_args[:root + 1], str(tmp_path / "reference"), *cli_args[root + 2:]]
    one_thread = {**env, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    straight = subprocess.run([sys.executable, "-m", "graphormer_urpe.cli.fit", "fit", *reference],
                              cwd=REPO, env=one_thread, capture_output=True, text=True, timeout=900)
    assert straight.returncode == 0, straight.stderr[-3000:]
    return (torch.load(tmp_path / "runs" / "tiny" / "urpe-s0" / "checkpoints" / "last.ckpt", weights_only=True),
            torch.load(tmp_path / "reference" / "checkpoints" / "last.ckpt", weights_only=True))


def test_time_budget_stops_the_fit_and_the_next_invocation_resumes_exactly(zinc_data_root, tmp_path):
    """``--time-budget``: each invocation trains until the budget is spent, when SIGTERM stops
    the fit (the run's whole state is saved in last.ckpt at the end of the step in progress), and
    writes the progress table into the README; the same command continues until the run is done
    and tested. Trained in several invocations, the run ends with the parameters and AdamW state
    of the same fit run uninterrupted, bit for bit, with dropout on. A callback of the test holds
    the first fit after step 5 until its SIGTERM arrives, so that the budget ends inside the run."""
    readme = tmp_path / "README.md"
    readme.write_text("# R\n<!-- ablation:tiny -->\n<!-- /ablation:tiny -->\n"
                      "<!-- ablation-progress:tiny -->\nnot yet\n<!-- /ablation-progress:tiny -->\nEnd.\n")
    steps = 16
    stall = ["--trainer.callbacks+", json.dumps({"class_path": "slow_steps.StallOnce", "init_args": {
        "step": 5, "marker": str(tmp_path / "stalled")}})]
    command = runner_command(tmp_path, zinc_data_root, "--arms", "urpe", "--trainer.max_steps", str(steps),
                             "--model.total_steps", str(steps), *stall, "--time-budget", "45s",
                             "--readme", str(readme))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO / "tests" / "helpers")}
    outputs = []
    for _ in range(8):
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        outputs.append(done.stdout)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        if read_results(tmp_path / "results.json"):
            break
        progress = readme.read_text()
        assert "not yet" not in progress and "| run | steps of 16 | best val MAE | latest val MAE |" in progress
        assert "| urpe-s0 | " in progress and "CPU" in progress
    [entry] = read_results(tmp_path / "results.json")
    assert entry["steps"] == steps and len(outputs) > 1
    assert f"| urpe-s0 | {steps} (done) |" in readme.read_text()
    trials = run_trials(tmp_path, "urpe")
    fits = [t.user_attrs["steps"] for t in trials if "steps" in t.user_attrs]
    # The budget stopped a fit inside the run, each fit continuing from where the last one stopped.
    assert any(t.state.name == "FAIL" and t.user_attrs["steps"][1] == 5 and t.user_attrs["fit_status"] == 143
               for t in trials if "steps" in t.user_attrs), [t.user_attrs for t in trials]
    assert [f[0] for f in fits[1:]] == [f[1] for f in fits[:-1]]
    assert fits[-1][1] == steps and trials[-1].state.name == "COMPLETE"

    sliced, whole = sliced_and_uninterrupted(tmp_path, trials[-1].user_attrs["args"], env)
    assert sliced["global_step"] == whole["global_step"] == steps
    assert sliced["state_dict"].keys() == whole["state_dict"].keys()
    for name, value in whole["state_dict"].items():
        assert torch.equal(sliced["state_dict"][name], value), name
    for index, state in whole["optimizer_states"][0]["state"].items():
        for key, value in state.items():
            assert torch.equal(sliced["optimizer_states"][0]["state"][index][key], value), (index, key)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["SIGTERM", "SIGHUP"])
def test_a_stop_signal_to_the_runner_saves_the_fit_in_progress_and_writes_the_progress(zinc_data_root, tmp_path,
                                                                                      name):
    """SIGTERM to the runner alone (a scheduler's stop), or SIGHUP to its process group (a closed
    terminal, which ended both on the spot): it stops its fit, which saves last.ckpt at the end of
    its step, writes the README's progress table, and exits 128 + the signal with one line."""
    signum = getattr(signal, name)
    readme = tmp_path / "README.md"
    readme.write_text("<!-- ablation:tiny -->\n<!-- /ablation:tiny -->\n"
                      "<!-- ablation-progress:tiny -->\n<!-- /ablation-progress:tiny -->\n")
    stall = ["--trainer.callbacks+", json.dumps({"class_path": "slow_steps.StallOnce", "init_args": {
        "step": 5, "marker": str(tmp_path / "stalled")}})]
    command = runner_command(tmp_path, zinc_data_root, "--arms", "urpe", *stall, "--time-budget", "10m",
                             "--readme", str(readme))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO / "tests" / "helpers")}
    runner = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    deadline = time.monotonic() + 300
    while not (tmp_path / "stalled").exists() and runner.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    if signum == signal.SIGHUP:
        os.killpg(runner.pid, signum)
    else:
        runner.send_signal(signum)
    out, err = runner.communicate(timeout=300)
    assert runner.returncode == 128 + signum, out[-2000:] + err[-2000:]
    assert err.strip().splitlines()[-1] == (f"graphormer-urpe-ablation: stopped by {name}; every run keeps its "
                                            "last.ckpt: the same command continues")
    assert "Traceback" not in err
    last = tmp_path / "runs" / "tiny" / "urpe-s0" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 5
    assert "| urpe-s0 | 5 |" in readme.read_text()
    [fit] = run_trials(tmp_path, "urpe")  # failed: the next invocation trains the run again
    assert fit.state.name == "FAIL" and fit.user_attrs["steps"] == [0, 5]
    assert fit.user_attrs["fit_status"] in {128 + signum, 143}  # its own SIGHUP, or the runner's SIGTERM first


@pytest.mark.parametrize("args, message", [
    (["--time-budget", "0"], "expected a positive duration"),
    (["--time-budget", "nine minutes"], "expected a duration such as 540, 540s, 9m or 1h30m"),
    (["--threads-per-job", "0"], "--threads-per-job must be >= 1, got 0"),
    (["--threads-per-job", "-2"], "--threads-per-job must be >= 1, got -2"),
    (["--seeds", "-1"], "--seeds must be integers from 0 to 4294967295 (2**32 - 1), got [-1]"),
    (["--seeds", "0", "0"], "--seeds and --arms must not repeat a value"),
    (["--time-budget", "9m", "--slice", "5m"], "unknown arguments ['--slice']"),  # the budget alone stops a fit
    (["--jobs", "2"], "unknown arguments ['--jobs']"),  # one invocation per job, each with its --seeds
])
def test_bad_runner_options_are_one_line_before_any_work(tmp_path, args, message):
    installed = str(Path(sys.executable).parent / "graphormer-urpe-ablation")
    done = subprocess.run([installed, "--runs-dir", str(tmp_path / "runs"), "--results",
                           str(tmp_path / "r.json"), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("name", ["../outside", "{tmp}/outside", "..", "a/b", ""])
def test_a_name_that_is_a_path_is_refused_before_any_work(tmp_path, name):
    """``--name`` is the grid's folder in ``--runs-dir``, as ``--study`` is the search's: a
    path would train the grid elsewhere."""
    name = name.format(tmp=tmp_path)
    installed = str(Path(sys.executable).parent / "graphormer-urpe-ablation")
    done = subprocess.run([installed, "--runs-dir", str(tmp_path / "runs" / "ablation"), "--results",
                           str(tmp_path / "r.json"), "--name", name, "--seeds", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "graphormer-urpe-ablation: error: --name must be a plain name (letters, digits, '.', '_', '-'; "
        f"not '.' or '..': it is a folder in --runs-dir), got {name!r}"], done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_the_results_and_table_default_to_the_runs_directory(tmp_path):
    """Without ``--results`` the table is written from ``<runs-dir>/results.json`` into
    ``results.md`` beside it (``runs/ablation`` of the current folder), and nowhere else."""
    installed = str(Path(sys.executable).parent / "graphormer-urpe-ablation")
    done = subprocess.run([installed, "--table-only"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == [
        "runs", "runs/ablation", "runs/ablation/results.md"]


def test_results_that_cannot_be_written_are_refused_before_any_run(tmp_path, run_main):
    (tmp_path / "file").write_text("")
    done = run_main(_main_status, ["--runs-dir", tmp_path / "runs", "--results", tmp_path / "file" / "r.json",
                                   "--seeds", "0"])
    assert done.returncode == 2 and done.stderr.strip() == (
        f"graphormer-urpe-ablation: error: --results {tmp_path / 'file'} cannot be written (File exists)")
    assert not (tmp_path / "runs").exists()


def test_a_rerun_with_other_arguments_is_refused_in_one_line(zinc_data_root, tmp_path, run_main):
    """The grid's study holds its recipe: the same --name with another recipe is refused in one
    line before any work (no data built, no run started)."""
    short = ["--arms", "rpe", "--trainer.max_steps", "2", "--model.total_steps", "2", "--model.warmup_steps", "1"]
    first = subprocess.run(runner_command(tmp_path, zinc_data_root, *short), cwd=REPO, capture_output=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"}, text=True, timeout=600)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    other = runner_command(tmp_path, tmp_path / "nothing built", *short, "--trainer.max_steps", "3",
                           "--model.total_steps", "3")
    done = run_main(_main_status, other[3:])
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("graphormer-urpe-ablation: error: study 'tiny' was created with another recipe "
                           "(different: the recipe's arguments)"), line
    assert not (tmp_path / "nothing built").exists() and ": fit" not in done.stdout


def _main_status(args) -> int:
    """The runner's main() as a status (its refusals raise SystemExit)."""
    try:
        main(args)
    except SystemExit as exit:
        return exit.code if isinstance(exit.code, int) else 1
    return 0


def _column(metrics_csv: Path, name: str) -> list[str]:
    import csv

    with open(metrics_csv, newline="") as handle:
        return [row[name] for row in csv.DictReader(handle) if row.get(name)]


def test_a_run_started_without_compile_continues_with_it(zinc_data_root, tmp_path):
    """``--model.compile`` says how the steps run, not what is trained: the grid's recipe (its
    study's, its default name) is the same with it, so a grid started without it continues with
    it (the committed paper ablation resumes compiled)."""
    from graphormer_urpe.training.lightning_cli import training_args
    from graphormer_urpe.training.studies.ablation import default_name

    recipe = ["--config", "configs/zinc.yaml", "--trainer.max_steps", "5"]
    assert training_args([*recipe, "--model.compile", "true"]) == training_args(recipe)
    assert default_name([*recipe, "--model.compile", "true"]) == default_name(recipe)
    assert default_name([*recipe, "--model.lr", "0.001"]) != default_name(recipe)


def test_unknown_runner_argument_is_an_error(capsys):
    from graphormer_urpe.cli.ablation import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--seed", "3"])
    assert "only LightningCLI overrides" in capsys.readouterr().err


def test_merge_replaces_the_same_run_and_keeps_the_rest(tmp_path):
    path = tmp_path / "r.json"
    base = {"recipe": "a", "seed": 0, "steps": 10, "val_mae": 0.5, "test_mae": 0.5,
            "wall_s": 1.0, "device": "cpu", "commit": "c"}
    publish_results(path, tmp_path / "r.md", [{**base, "attention": "urpe"}, {**base, "attention": "rpe"}])
    table = publish_results(path, tmp_path / "r.md", [{**base, "attention": "urpe", "test_mae": 0.4},
                                                      {**base, "attention": "urpe", "seed": 1}])
    assert [(e["attention"], e["seed"], e["test_mae"]) for e in read_results(path)] == [
        ("rpe", 0, 0.5), ("urpe", 0, 0.4), ("urpe", 1, 0.5)]
    assert table == (tmp_path / "r.md").read_text() == format_table(read_results(path))


def test_table_means_sample_std_and_paired_differences():
    def entry(arm, seed, val, test):
        return {"recipe": "r", "attention": arm, "seed": seed, "steps": 100, "val_mae": val,
                "test_mae": test, "wall_s": 60.0, "device": "cpu", "commit": "c", "budget": "b"}

    entries = [entry("urpe", 0, 0.50, 0.40), entry("urpe", 1, 0.60, 0.60),
               entry("rpe", 0, 0.55, 0.50), entry("rpe", 1, 0.50, 0.50)]
    table = format_table(entries)
    assert "| urpe | 2 | 0, 1 | 100 | 0.5500 ± 0.0707 | 0.5000 ± 0.1414 | 1.0 |" in table
    assert "| rpe | 2 | 0, 1 | 100 | 0.5250 ± 0.0354 | 0.5000 ± 0.0000 | 1.0 |" in table
    assert "| 0 | -0.0500 | -0.1000 |" in table and "| 1 | +0.1000 | +0.1000 |" in table
    assert "| mean ± std | +0.0250 ± 0.1061 | +0.0000 ± 0.1414 |" in table
    assert "urpe has the lower test MAE in 1 of 2 seeds." in table


def test_backbone_overrides_from_a_dict_or_a_typed_config():
    from jsonargparse import Namespace

    assert backbone_overrides(None) == {}
    assert backbone_overrides({"attention": "urpe", "num_layers": 2}) == {"attention": "urpe",
                                                                          "num_layers": 2}
    # a typed backbone parses to a namespace whose unset fields are None
    assert backbone_overrides(Namespace(num_layers=4, attention=None)) == {"num_layers": 4}


def test_readme_without_the_block_is_refused_before_training(tmp_path, run_main):
    readme = tmp_path / "README.md"
    readme.write_text("# Results\n")
    done = run_main(_main_status, ["--name", "n", "--runs-dir", tmp_path / "runs", "--results",
                                   tmp_path / "r.json", "--readme", readme, "--seeds", "0"])
    assert done.returncode == 2 and "needs one line <!-- ablation:n --> and, after it" in done.stderr
    assert not (tmp_path / "runs").exists()


def test_crafted_state_in_a_run_directory_is_refused_without_running_its_code(
        zinc_data_root, tmp_path, plant_crafted_checkpoint):
    """Resuming reads the run's last.ckpt as plain data: a planted file whose unpickling runs
    code is refused in one line before any run."""
    crafted = tmp_path / "runs" / "tiny" / "rpe-s0/checkpoints/last.ckpt"
    marker = plant_crafted_checkpoint(crafted)
    done = subprocess.run(runner_command(tmp_path, zinc_data_root, "--arms", "rpe"),
                          cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"graphormer-urpe-ablation: error: checkpoint {crafted} cannot be read: it holds objects other "
        "than tensors and plain values, which are never loaded"), done.stderr[-3000:]
    assert not marker.exists()
    assert ": fit" not in done.stdout  # refused before the run started


def test_the_runs_import_no_module_of_the_folder_the_command_runs_in(zinc_data_root, tmp_path):
    """A ``torchmetrics.py`` in the current folder is the user's file, not the library: the
    installed command's fit and test import the installed one, and the planted file never runs."""
    work, marker = tmp_path / "work", tmp_path / "planted module ran"
    work.mkdir()
    (work / "torchmetrics.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    command = [str(Path(sys.executable).parent / "graphormer-urpe-ablation"),
               *runner_command(tmp_path, zinc_data_root, "--arms", "rpe", "--trainer.max_steps", "2",
                               "--model.total_steps", "2", "--model.warmup_steps", "1")[3:]]
    del command[command.index("--results"):command.index("--results") + 2]  # the default, in --runs-dir
    done = subprocess.run(command, cwd=work, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert ": test" in done.stdout and read_results(tmp_path / "runs" / "results.json")
    assert not marker.exists() and [p.name for p in work.iterdir()] == ["torchmetrics.py"]


@pytest.mark.parametrize("python", [(3, 11), (3, 10)])
def test_a_command_run_without_its_console_script_imports_nothing_of_the_current_folder(
        tmp_path, monkeypatch, python):
    """Where no console script stands beside the interpreter, a child command is the interpreter
    running the module (``-P -m``; on Python 3.10, which has no ``-P``, ``runpy``): a module of the
    current folder is not found, one on ``PYTHONPATH`` is."""
    from graphormer_urpe.training.studies import study

    work, on_path = tmp_path / "work", tmp_path / "on_path"
    for folder in (work, on_path):
        folder.mkdir()
        (folder / "shadowed.py").write_text(f"print({folder.name!r})\n")
    (work / "only_here.py").write_text("print('imported')\n")
    with monkeypatch.context() as patch:
        patch.setattr(study.sys, "version_info", python)
        commands = {name: study.console_command("no-such-script", name) for name in ("shadowed", "only_here")}
    env = {**os.environ, "PYTHONPATH": str(on_path)}
    shadowed = subprocess.run(commands["shadowed"], cwd=work, env=env, capture_output=True, text=True, timeout=60)
    assert (shadowed.returncode, shadowed.stdout) == (0, "on_path\n"), shadowed.stderr
    only_here = subprocess.run(commands["only_here"], cwd=work, env=env, capture_output=True, text=True, timeout=60)
    assert only_here.returncode == 1 and "No module named only_here" in only_here.stderr, only_here.stderr

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

from graphormer_urpe.ablation import backbone_overrides, main
from graphormer_urpe.ablation_results import format_table, merge_results
from graphormer_urpe.files import read_json
from graphormer_urpe.training.ensemble import LEGACY_STATE_FILE, STATE_FILE
from graphormer_urpe.prediction.load import best_checkpoint

REPO = Path(__file__).resolve().parents[1]
TINY_BACKBONE = {"num_layers": 2, "hidden_dim": 16, "ffn_dim": 16, "num_heads": 2}
STEPS = 16  # 8 epochs of 2 batches, each validated: long enough to be killed part-way


def runner_command(tmp_path: Path, data_root: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "graphormer_urpe.ablation",
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


def run_record(tmp_path: Path, arm: str) -> dict:
    return json.loads((tmp_path / "runs" / "tiny" / f"{arm}-s0" / "ablation_run.json").read_text())


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
    killed = run_record(tmp_path, "urpe")
    assert "result" not in killed and not killed.get("fit_done")
    steps_at_kill = torch.load(last, map_location="cpu", weights_only=False)["global_step"]
    assert 0 < steps_at_kill < STEPS

    # Run again: the killed run resumes, the other one runs, both are tested.
    finished = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    assert f"urpe-s0: fit (resuming from last.ckpt at step {steps_at_kill})" in finished.stdout
    urpe = run_record(tmp_path, "urpe")
    fits = [a for a in urpe["attempts"] if a["stage"] == "fit"]
    assert len(fits) == 2 and fits[0]["returncode"] is None and fits[1]["returncode"] == 0
    assert "Restoring states from the checkpoint path" in (last.parents[1] / "fit.log").read_text()
    args = urpe["cli_args"]  # the arm's backbone comes last and keeps the recipe's sizes
    last_backbone = len(args) - 1 - args[::-1].index("--model.backbone")
    recipe = yaml.safe_load((REPO / "configs" / "zinc.yaml").read_text())["model"]["backbone"]
    assert json.loads(args[last_backbone + 1]) == {**recipe, **TINY_BACKBONE, "attention": "urpe",
                                                   "share_urpe_scale": False}

    entries = read_json(results, [])
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
        assert bool(scales) == (arm == "urpe"), run_record(tmp_path, arm)["cli_args"]
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
    assert run_record(tmp_path, "urpe")["attempts"] == urpe["attempts"]
    assert read_json(results, []) == entries


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
    [entry] = [e for e in read_json(tmp_path / "results.json", []) if e["recipe"] == "tiny"]
    assert entry["steps"] == 5 and entry["best_step"] in (2, 4)
    # the lock is the kernel's: the next runner (all done now) takes it and runs nothing
    main(command[3:])
    again = capsys.readouterr().out
    assert "tiny: 1 runs" in again and ": fit" not in again


@pytest.mark.slow
def test_ensemble_grid_resumes_tests_each_member_and_writes_the_readme_table(zinc_data_root, tmp_path):
    """``--ensemble``: both runs train in the runner's process as one stacked model; Ctrl-C stops
    it at the end of the epoch in progress with its state saved (exit status 130), and the same
    command resumes the ensemble from there; each member is tested as a solo run is."""
    readme = tmp_path / "README.md"
    readme.write_text("# Results\n\n<!-- ablation:tiny -->\nnot run yet\n<!-- /ablation:tiny -->\n\nAfter.\n")
    command = runner_command(tmp_path, zinc_data_root, "--ensemble", "--readme", str(readme),
                             "--figures", str(tmp_path / "figures"))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    state = tmp_path / "runs" / "tiny" / "ensemble" / STATE_FILE
    status, output = signal_once_written(command, state, env, signal.SIGINT)
    steps_at_kill = torch.load(state, map_location="cpu", weights_only=True)["global_step"]
    assert status == 130, output[-3000:]
    assert f"ensemble: SIGINT: stopped at the end of epoch {steps_at_kill // 2 - 1} (step {steps_at_kill})" in output
    assert output.strip().splitlines()[-1] == (
        f"graphormer-urpe-ablation: stopped by SIGINT at the end of an epoch (step {steps_at_kill}); "
        "its state is saved: the same command resumes it"), output[-3000:]
    assert 0 < steps_at_kill < STEPS and steps_at_kill % 2 == 0  # an epoch's end

    # The same command continues it, here as the installed `graphormer-urpe-ablation` with the
    # members' steps in turn and the fused attention core (how a step runs, not what it trains;
    # on a CPU the core falls back to the eager one, whose kernels test_ensemble checks).
    installed = str(Path(sys.executable).parent / "graphormer-urpe-ablation")
    finished = subprocess.run([installed, *command[3:], "--in-turn", "--attention-impl", "triton"], cwd=REPO,
                              env=env, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    assert "as one ensemble (members in turn, triton attention)" in finished.stdout
    assert "on this CPU the members' attention runs the eager core" in finished.stdout
    assert f"ensemble: resuming at step {steps_at_kill}" in finished.stdout
    assert "tiny took" in finished.stdout
    runs = {e["attention"]: e for e in read_json(tmp_path / "results.json", [])}
    assert set(runs) == {"urpe", "rpe"}
    for arm, entry in runs.items():
        assert entry["steps"] == STEPS and 0 < entry["best_step"] <= STEPS
        assert 0 < entry["val_mae"] < 10 and 0 < entry["test_mae"] < 10
        assert "--ensemble" in entry["device"]
        record = run_record(tmp_path, arm)
        fits = [a for a in record["attempts"] if a["stage"] == "fit-ensemble"]
        assert [a["returncode"] for a in fits] == [130, 0] and record["fit_done"]
        assert [a["stage"] for a in record["attempts"]][-1] == "test"
        path, val_mae, _, _, _ = best_checkpoint(tmp_path / "runs" / "tiny" / f"{arm}-s0")
        best = torch.load(path, map_location="cpu", weights_only=False)
        assert best["hyper_parameters"]["backbone"]["attention"] == arm
        assert any("urpe_scales" in k for k in best["state_dict"]) == (arm == "urpe")
        metrics = tmp_path / "runs" / "tiny" / f"{arm}-s0" / "csv" / "ensemble" / "metrics.csv"
        assert min(float(v) for v in _column(metrics, "val/mae")) == pytest.approx(val_mae, abs=1e-6)
    png = tmp_path / "figures" / "tiny-tables.png"  # B and C read from the members' checkpoints
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = readme.read_text()
    assert "not run yet" not in text and text.endswith("<!-- /ablation:tiny -->\n\nAfter.\n")
    assert f"| urpe | 1 | 0 | {STEPS} | {runs['urpe']['val_mae']:.4f} | {runs['urpe']['test_mae']:.4f}" in text


def test_ensemble_refuses_the_shared_arm(capsys):
    from graphormer_urpe.ablation import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--ensemble", "--arms", "urpe", "urpe-shared"])
    assert "--ensemble trains the arms urpe and rpe" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--cuda-graph", "--in-turn"])
def test_options_of_the_ensemble_step_need_the_ensemble(capsys, flag):
    from graphormer_urpe.ablation import parse_args

    with pytest.raises(SystemExit):
        parse_args([flag])
    assert "--cuda-graph and --in-turn change the --ensemble step: add --ensemble" in capsys.readouterr().err


def test_the_fused_attention_core_needs_the_members_in_turn(capsys):
    from graphormer_urpe.ablation import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--ensemble", "--attention-impl", "triton"])
    assert ("--attention-impl triton runs the members of --ensemble --in-turn (vmap cannot batch the "
            "fused kernels); a solo run takes --model.backbone.attention_impl triton") in capsys.readouterr().err
    from graphormer_urpe.training.ensemble import ENSEMBLE_ATTENTION_IMPLS

    for impl in ENSEMBLE_ATTENTION_IMPLS:  # every core an ensemble runs, and no other
        assert parse_args(["--ensemble", "--in-turn", "--attention-impl", impl])[0].attention_impl == impl
    with pytest.raises(SystemExit):
        parse_args(["--ensemble", "--in-turn", "--attention-impl", "sdpa"])


def _column(metrics_csv: Path, name: str) -> list[str]:
    import csv

    with open(metrics_csv, newline="") as handle:
        return [row[name] for row in csv.DictReader(handle) if row.get(name)]


def test_changed_recipe_under_the_same_name_is_refused(zinc_data_root, tmp_path):
    from graphormer_urpe.ablation import Grid, parse_args

    args, overrides = parse_args(["--name", "n", "--runs-dir", str(tmp_path), "--seeds", "0",
                                  "--arms", "rpe", "--trainer.max_steps", "5"])
    run = Grid(args, overrides).runs[0]
    run.dir.mkdir(parents=True)
    (run.record_path).write_text(json.dumps({"cli_args": ["--trainer.max_steps", "4"],
                                             "attempts": []}))
    with pytest.raises(ValueError, match="started with other arguments"):
        run.load_record()


def test_a_run_started_without_compile_continues_with_it(zinc_data_root, tmp_path):
    """``--model.compile`` says how the steps run, not what is trained: a run directory started
    without it continues with it (the committed paper ablation resumes compiled), and a grid's
    default name stays the same."""
    from graphormer_urpe.ablation import Grid, default_name, parse_args

    def grid(*extra):
        args, overrides = parse_args(["--name", "n", "--runs-dir", str(tmp_path), "--seeds", "0",
                                      "--arms", "rpe", "--trainer.max_steps", "5", *extra])
        return Grid(args, overrides)

    plain = grid().runs[0]
    plain.dir.mkdir(parents=True)
    plain.record_path.write_text(json.dumps({"cli_args": plain.cli_args, "attempts": []}))
    compiled = grid("--model.compile", "true").runs[0]
    assert "--model.compile" in compiled.cli_args
    assert compiled.load_record()["cli_args"] == plain.cli_args
    recipe = ["--config", "configs/zinc.yaml", "--trainer.max_steps", "5"]
    assert default_name([*recipe, "--model.compile", "true"]) == default_name(recipe)
    assert default_name([*recipe, "--model.lr", "0.001"]) != default_name(recipe)


def test_unknown_runner_argument_is_an_error(capsys):
    from graphormer_urpe.ablation import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--seed", "3"])
    assert "only LightningCLI overrides" in capsys.readouterr().err


def test_merge_replaces_the_same_run_and_keeps_the_rest(tmp_path):
    path = tmp_path / "r.json"
    base = {"recipe": "a", "seed": 0, "steps": 10, "val_mae": 0.5, "test_mae": 0.5,
            "wall_s": 1.0, "device": "cpu", "commit": "c"}
    merge_results(path, [{**base, "attention": "urpe"}, {**base, "attention": "rpe"}])
    merged = merge_results(path, [{**base, "attention": "urpe", "test_mae": 0.4},
                                  {**base, "attention": "urpe", "seed": 1}])
    assert [(e["attention"], e["seed"], e["test_mae"]) for e in merged] == [
        ("rpe", 0, 0.5), ("urpe", 0, 0.4), ("urpe", 1, 0.5)]


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


def test_readme_without_the_block_is_refused_before_training(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# Results\n")
    with pytest.raises(SystemExit, match="needs one line <!-- ablation:n --> and, after it"):
        main(["--name", "n", "--runs-dir", str(tmp_path / "runs"), "--results",
              str(tmp_path / "r.json"), "--readme", str(readme), "--seeds", "0"])
    assert not (tmp_path / "runs").exists()


def test_ensemble_refuses_a_recipe_it_cannot_train_with_one_line(zinc_data_root, tmp_path):
    command = runner_command(tmp_path, zinc_data_root, "--ensemble",
                             "--trainer.accumulate_grad_batches", "2")
    with pytest.raises(SystemExit, match="error: --ensemble does not support these trainer "
                                         r"settings: \['accumulate_grad_batches'\]"):
        main(command[3:])  # the arguments after `python -m graphormer_urpe.ablation`


@pytest.mark.parametrize("planted", ["rpe-s0/checkpoints/last.ckpt", f"ensemble/{STATE_FILE}",
                                     f"ensemble/{LEGACY_STATE_FILE}"])
def test_crafted_state_in_a_run_directory_is_refused_without_running_its_code(
        zinc_data_root, tmp_path, plant_crafted_checkpoint, planted):
    """Resuming reads the run's last.ckpt (and, with --ensemble, the ensemble's state, or an
    earlier version's) as plain data: a planted file whose unpickling runs code is refused in one
    line before any run."""
    crafted = tmp_path / "runs" / "tiny" / planted
    marker = plant_crafted_checkpoint(crafted)
    ensemble = ["--ensemble"] if planted.startswith("ensemble") else []
    done = subprocess.run(runner_command(tmp_path, zinc_data_root, "--arms", "rpe", *ensemble),
                          cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=600)
    what = "ensemble state" if ensemble else "checkpoint"
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"graphormer-urpe-ablation: error: {what} {crafted} cannot be read: it holds objects other "
        "than tensors and plain values, which are never loaded"), done.stderr[-3000:]
    assert not marker.exists()
    assert ensemble or ": fit" not in done.stdout  # refused before the run started

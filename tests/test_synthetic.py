"""Synthetic tasks: targets, training, the resumable grid, reports and the URPE plots."""
import dataclasses
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from graphormer_urpe.cli import synthetic as synthetic_command
from graphormer_urpe.training.studies import synthetic
from graphormer_urpe.training.studies.synthetic import (
    IGNORE_INDEX, RESULTS_BEGIN, RESULTS_END, TrainConfig, cell_name, even_token_targets, make_batch,
    num_classes, position_identification_targets, run_grid, task_config, train_cell)

REPO = Path(__file__).resolve().parents[1]
# Small enough that a cell trains in about a second on the 2-core box.
TINY = TrainConfig(length=16, embed_dim=16, num_heads=2, num_layers=2, ffn_dim=32, batch_size=8,
                   steps=40, lr=3e-3, warmup_steps=4, eval_batches=2)


def _even_token_reference(tokens):
    """The paper's 1-based definition written out: output i is w_{2i} while 2i <= n, then EOS,
    then nothing (None) for the remaining positions."""
    n = len(tokens)
    outputs = [tokens[2 * i - 1] for i in range(1, n + 1) if 2 * i <= n] + ["EOS"]
    return (outputs + [None] * n)[:n]


@pytest.mark.parametrize("length", [1, 2, 5, 8, 128])
def test_even_token_targets_follow_the_definition(length):
    tokens = torch.randint(50, (3, length), dtype=torch.int32, generator=torch.Generator().manual_seed(length))
    targets = even_token_targets(tokens, eos=50)
    assert targets.dtype == torch.long
    for row, target in zip(tokens.tolist(), targets.tolist()):
        expected = _even_token_reference(row)
        decoded = ["EOS" if t == 50 else None if t == IGNORE_INDEX else t for t in target]
        assert decoded == expected
    if length == 128:  # 64 tokens, one EOS, 63 ignored
        assert (targets[0] != IGNORE_INDEX).sum() == 65 and targets[0, 64] == 50


def test_position_identification_targets_are_the_positions():
    tokens = torch.randint(10, (4, 9), dtype=torch.int32)
    assert torch.equal(position_identification_targets(tokens), torch.arange(9).expand(4, 9))


def test_batches_are_seeded_and_in_range():
    a = make_batch("etp", 4, 32, 1000, torch.Generator().manual_seed(7))
    b = make_batch("etp", 4, 32, 1000, torch.Generator().manual_seed(7))
    c = make_batch("etp", 4, 32, 1000, torch.Generator().manual_seed(8))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and not torch.equal(a[0], c[0])
    assert a[0].dtype == torch.int32 and 0 <= a[0].min() and a[0].max() < 1000
    assert num_classes("etp", 1000, 32) == 1001 and num_classes("pi", 1000, 32) == 32


def test_bad_task_or_sizes_raise():
    with pytest.raises(ValueError, match="task"):
        make_batch("copy", 2, 8, 10, torch.Generator())
    with pytest.raises(ValueError, match="vocab_size"):
        make_batch("pi", 2, 8, 0, torch.Generator())
    with pytest.raises(ValueError, match="steps"):
        TrainConfig(steps=0)


def test_a_few_training_steps_reduce_the_loss():
    result, model, losses = train_cell("pi", 50, "ape", seed=0, config=TINY, progress=False)
    assert len(losses) == TINY.steps
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.7 * first, (first, last)
    assert result.accuracy > 1 / TINY.length  # better than guessing a position


def _forbid_training(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("a finished cell was retrained")
    monkeypatch.setattr(synthetic, "train_cell", fail)


def test_grid_resumes_without_retraining_finished_cells(tmp_path, monkeypatch):
    grid = dict(tasks=["pi"], vocab_sizes=[30], schemes=["rpe", "urpe"], seeds=[0])
    first = run_grid(**grid, config=TINY, run_dir=tmp_path, progress=False)
    names = [cell_name("pi", 30, scheme, 0, TINY) for scheme in ("rpe", "urpe")]
    assert names[0].startswith("pi-L16-v30-rpe-s0-")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"{n}.{ext}" for n in names for ext in ("json", "pt"))

    with monkeypatch.context() as m:
        _forbid_training(m)
        again = run_grid(**grid, config=TINY, run_dir=tmp_path, progress=False)
    assert again == first

    # A grid killed after its first cell: only the missing cell is trained.
    (tmp_path / f"{names[1]}.json").unlink()
    trained = []
    real = synthetic.train_cell
    monkeypatch.setattr(synthetic, "train_cell",
                        lambda *a, **k: trained.append(a[:4]) or real(*a, **k))
    resumed = run_grid(**grid, config=TINY, run_dir=tmp_path, progress=False)
    assert trained == [("pi", 30, "urpe", 0)]
    assert resumed[0] == first[0]
    # Changed settings train a new cell beside the old one.
    trained.clear()
    shorter = dataclasses.replace(TINY, steps=5)
    run_grid(**{**grid, "schemes": ["rpe"]}, config=shorter, run_dir=tmp_path, progress=False)
    assert trained == [("pi", 30, "rpe", 0)]
    assert (tmp_path / f"{cell_name('pi', 30, 'rpe', 0, shorter)}.json").exists()


def test_task_configs_apply_overrides_on_top_of_task_defaults():
    assert task_config("etp").length == synthetic.TASK_OVERRIDES["etp"]["length"]
    assert task_config("pi").length == TrainConfig().length
    assert task_config("etp", steps=7, lr=None).steps == 7  # None = keep the task's value
    with pytest.raises(ValueError, match="unknown"):
        task_config("pi", epochs=3)
    assert TrainConfig().fingerprint() == task_config("pi").fingerprint()
    assert TrainConfig().fingerprint() != dataclasses.replace(TrainConfig(), lr=1e-4).fingerprint()


def test_main_writes_json_csv_and_markdown_block(tmp_path, capsys):
    markdown = tmp_path / "synthetic.md"
    markdown.write_text(f"# Title\n\nProse before.\n\n{RESULTS_BEGIN}\nold\n{RESULTS_END}\n\nProse after.\n")
    argv = ["--tasks", "etp", "--vocab-sizes", "40", "--schemes", "ape", "rpe", "--seeds", "0", "1",
            "--run-dir", str(tmp_path / "runs"), "--results-dir", str(tmp_path / "results"),
            "--markdown", str(markdown), "--no-progress"]
    for name, value in TINY.__dict__.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    argv[argv.index("--steps") + 1] = "10"
    results = synthetic_command.run(argv)
    assert len(results) == 4
    text = markdown.read_text()
    assert text.startswith("# Title\n\nProse before.") and text.endswith("Prose after.\n")
    assert "old" not in text and "| Even Token Prediction | 16 | 40 | rpe | 10 | s0: " in text
    payload = json.loads((tmp_path / "results" / "synthetic.json").read_text())
    assert [row["scheme"] for row in payload["summary"]] == ["ape", "rpe"]
    per_position = payload["cells"][0]["position_accuracy"]  # ETP, length 16: 8 tokens + EOS
    assert len(per_position) == 16 and per_position[9:] == [None] * 7
    assert all(0 <= a <= 1 for a in per_position[:9])
    for row in payload["summary"]:
        assert row["seeds"] == [0, 1]
        assert row["mean"] == pytest.approx(sum(row["accuracies"]) / 2)
    csv_lines = (tmp_path / "results" / "synthetic.csv").read_text().splitlines()
    assert csv_lines[0].startswith("task,length,vocab_size,scheme,seed,steps,accuracy")
    assert len(csv_lines) == 5
    assert "| Even Token Prediction |" in capsys.readouterr().out


def _console_command(tmp_path: Path, steps: int) -> list[str]:
    """``graphormer-urpe-synthetic`` on one TINY cell of ``steps`` steps."""
    script = Path(sys.executable).with_name("graphormer-urpe-synthetic")
    argv = [str(script), "--tasks", "pi", "--vocab-sizes", "40", "--schemes", "urpe", "--seeds", "0",
            "--run-dir", str(tmp_path / "runs"), "--results-dir", str(tmp_path / "results"),
            "--markdown", "", "--no-progress"]
    for name, value in TINY.__dict__.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    argv[argv.index("--steps") + 1] = str(steps)
    return argv


def test_console_script_exits_zero_after_a_successful_grid(tmp_path):
    argv = _console_command(tmp_path, steps=2)
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "| urpe |" in result.stdout


def test_console_script_writes_nothing_outside_its_run_dir_by_default(tmp_path):
    """Run in a folder that has a ``docs/synthetic.md`` of its own, without ``--results-dir`` or
    ``--markdown``: the tables go beside the cells in ``runs/synthetic``, the user's docs stay."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "synthetic.md").write_text("# The user's own page\n")
    argv = _console_command(tmp_path, steps=2)
    for option in ("--run-dir", "--results-dir", "--markdown"):
        del argv[argv.index(option):argv.index(option) + 2]
    result = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "docs" / "synthetic.md").read_text() == "# The user's own page\n"
    assert sorted(p.name for p in (tmp_path / "docs").iterdir()) == ["synthetic.md"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs", "runs"]
    written = {p.name for p in (tmp_path / "runs" / "synthetic").iterdir()}
    assert {"synthetic.json", "synthetic.csv"} <= written and len(written) == 4  # and the cell's .json, .pt


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_console_script_stopped_while_it_trains_says_so_in_one_line(tmp_path, signum):
    """SIGTERM (a scheduler) or Ctrl-C while the grid trains its first cell: one line naming the
    signal, exit status 128 + the signal, no traceback, no temporary file in the run folder."""
    process = subprocess.Popen(_console_command(tmp_path, steps=1_000_000), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "runs").is_dir() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)  # into its training steps
    os.killpg(process.pid, signum)
    out, err = process.communicate(timeout=120)
    said = "Ctrl-C (SIGINT)" if signum == signal.SIGINT else signal.Signals(signum).name
    assert process.returncode == 128 + signum, out[-2000:] + err[-3000:]
    assert err.strip().splitlines() == [f"graphormer-urpe-synthetic: stopped by {said}; outputs not yet "
                                        "written are left as they were"]
    assert list((tmp_path / "runs").iterdir()) == [] and not (tmp_path / "results").exists()


def _plot_module():
    return importlib.import_module("graphormer_urpe.cli.plot")


def _learned_tables():
    return importlib.import_module("graphormer_urpe.cli.learned_tables")


def test_plot_script_renders_a_trained_sequence_model(tmp_path):
    plot = _plot_module()
    brief = dataclasses.replace(TINY, steps=5)  # moves the tables off their init
    run_grid(["pi"], [30], ["urpe"], [0], brief, tmp_path / "runs", progress=False)
    name = cell_name("pi", 30, "urpe", 0, brief)
    checkpoint = tmp_path / "runs" / f"{name}.pt"
    paths = plot.main([str(checkpoint), "--out", str(tmp_path / "figs"), "--max-offset", "8"])
    assert sorted(p.name for p in paths) == [f"{name}-B.png", f"{name}-C.png", f"{name}-offsets.png"]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5_000
    # The pictures show the trained model's tables, laid out as Toeplitz matrices.
    state = torch.load(checkpoint, weights_only=True)["state_dict"]
    tables = _learned_tables().sequence_tables(state)
    assert torch.equal(torch.from_numpy(tables["scale"][1]), state["layers.1.scale.table"])
    matrix = _learned_tables().toeplitz(tables["scale"][0, 1], 5)
    assert matrix[3, 1] == state["layers.0.scale.table"][1, (1 - 3) + TINY.length - 1]


def test_plot_script_renders_graph_urpe_tables_from_a_lightning_checkpoint(tmp_path):
    from graphormer_urpe.data.facts import DataFacts
    from graphormer_urpe.training.module import GraphormerModule

    plot = _plot_module()
    hparams = {"num_atom_embeddings": 29, "num_bond_embeddings": 5,
               "backbone": {"num_layers": 3, "hidden_dim": 16, "ffn_dim": 16, "num_heads": 4,
                            "max_spd": 6}}
    module = GraphormerModule(**DataFacts.nest(hparams))  # saved flat, as checkpoints before
    model = module.model
    with torch.no_grad():  # stand in for training: C varies with distance, layer and head
        for scale in model.urpe_scales:
            scale.delta.add_(torch.randn(scale.delta.shape))
    checkpoint = {"state_dict": module.state_dict(), "epoch": 3, "hyper_parameters": hparams}
    torch.save(checkpoint, tmp_path / "graph.ckpt")
    spatial, scales = _learned_tables().graph_tables(tmp_path / "graph.ckpt")
    assert scales.shape == (3, 6 + 3, 4) and spatial.shape == (6 + 2, 4)
    assert torch.equal(torch.from_numpy(scales[2]), 1 + model.urpe_scales[2].delta.detach())
    paths = plot.main([str(tmp_path / "graph.ckpt"), "--out", str(tmp_path)])
    assert [p.name for p in paths] == ["graph-spd.png"] and paths[0].stat().st_size > 5_000
    rpe = {"num_atom_embeddings": 29, "num_bond_embeddings": 5, "backbone": {"attention": "rpe"}}
    torch.save({"state_dict": GraphormerModule(**DataFacts.nest(rpe)).state_dict(), "hyper_parameters": rpe},
               tmp_path / "rpe.ckpt")
    with pytest.raises(ValueError, match="no URPE scale"):
        plot.main([str(tmp_path / "rpe.ckpt"), "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="neither"):
        torch.save(module.model.state_dict(), tmp_path / "bare.pt")
        plot.main([str(tmp_path / "bare.pt"), "--out", str(tmp_path)])

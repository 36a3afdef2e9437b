"""Synthetic tasks: targets, training, the resumable grid, reports and the URPE plots."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from graphormer_urpe import synthetic
from graphormer_urpe.synthetic import (IGNORE_INDEX, RESULTS_BEGIN, RESULTS_END, TrainConfig,
                                       even_token_targets, make_batch, num_classes,
                                       position_identification_targets, run_grid, train_cell)

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
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "pi-v30-rpe-s0.json", "pi-v30-rpe-s0.pt", "pi-v30-urpe-s0.json", "pi-v30-urpe-s0.pt"]

    with monkeypatch.context() as m:
        _forbid_training(m)
        again = run_grid(**grid, config=TINY, run_dir=tmp_path, progress=False)
    assert again == first

    # A grid killed after its first cell: only the missing cell is trained.
    (tmp_path / "pi-v30-urpe-s0.json").unlink()
    trained = []
    real = synthetic.train_cell
    monkeypatch.setattr(synthetic, "train_cell",
                        lambda *a, **k: trained.append(a[:4]) or real(*a, **k))
    resumed = run_grid(**grid, config=TINY, run_dir=tmp_path, progress=False)
    assert trained == [("pi", 30, "urpe", 0)]
    assert resumed[0] == first[0]
    # Changed settings invalidate the stored cells.
    trained.clear()
    run_grid(**{**grid, "schemes": ["rpe"]}, config=TrainConfig(**{**TINY.__dict__, "steps": 5}),
             run_dir=tmp_path, progress=False)
    assert trained == [("pi", 30, "rpe", 0)]


def test_main_writes_json_csv_and_markdown_block(tmp_path, capsys):
    markdown = tmp_path / "synthetic.md"
    markdown.write_text(f"# Title\n\nProse before.\n\n{RESULTS_BEGIN}\nold\n{RESULTS_END}\n\nProse after.\n")
    argv = ["--tasks", "etp", "--vocab-sizes", "40", "--schemes", "ape", "rpe", "--seeds", "0", "1",
            "--run-dir", str(tmp_path / "runs"), "--results-dir", str(tmp_path / "results"),
            "--markdown", str(markdown), "--no-progress"]
    for name, value in TINY.__dict__.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    argv[argv.index("--steps") + 1] = "10"
    results = synthetic.main(argv)
    assert len(results) == 4
    text = markdown.read_text()
    assert text.startswith("# Title\n\nProse before.") and text.endswith("Prose after.\n")
    assert "old" not in text and "| Even Token Prediction | 40 | rpe | s0: " in text
    payload = json.loads((tmp_path / "results" / "synthetic.json").read_text())
    assert [row["scheme"] for row in payload["summary"]] == ["ape", "rpe"]
    for row in payload["summary"]:
        assert row["seeds"] == [0, 1]
        assert row["mean"] == pytest.approx(sum(row["accuracies"]) / 2)
    csv_lines = (tmp_path / "results" / "synthetic.csv").read_text().splitlines()
    assert csv_lines[0].startswith("task,vocab_size,scheme,seed,accuracy") and len(csv_lines) == 5
    assert "| Even Token Prediction |" in capsys.readouterr().out

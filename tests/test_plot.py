"""``graphormer-urpe-plot``, the installed command (the figures themselves: test_synthetic.py)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from graphormer_urpe.data.facts import DataFacts
from graphormer_urpe.training.module import GraphormerModule

PLOT = Path(sys.executable).with_name("graphormer-urpe-plot")


def test_installed_command_writes_the_figure_and_exits_0(tmp_path):
    hparams = {"num_atom_embeddings": 29, "num_bond_embeddings": 5,
               "backbone": {"num_layers": 2, "hidden_dim": 16, "ffn_dim": 16, "num_heads": 2,
                            "max_spd": 6}}
    # the facts saved flat, as checkpoints written before they were one object
    torch.save({"state_dict": GraphormerModule(**DataFacts.nest(hparams)).state_dict(), "hyper_parameters": hparams},
               tmp_path / "g.ckpt")
    assert PLOT.is_file(), f"{PLOT} is not installed (pip install -e .)"
    result = subprocess.run([str(PLOT), str(tmp_path / "g.ckpt"), "--out", str(tmp_path / "figs")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == [str(tmp_path / "figs" / "g-spd.png")]
    assert (tmp_path / "figs" / "g-spd.png").read_bytes()[:4] == b"\x89PNG"


def test_crafted_checkpoint_is_refused_in_one_line_without_running_its_code(tmp_path,
                                                                          plant_crafted_checkpoint):
    crafted = tmp_path / "crafted.ckpt"
    marker = plant_crafted_checkpoint(crafted)
    result = subprocess.run([str(PLOT), str(crafted), "--out", str(tmp_path / "figs")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        f"graphormer-urpe-plot: error: checkpoint {crafted} cannot be read: it holds objects other "
        "than tensors and plain values, which are never loaded"]
    assert not marker.exists() and not (tmp_path / "figs").exists()


def test_a_plot_stopped_while_it_writes_keeps_the_previous_figure(tmp_path, monkeypatch, capsys):
    """Ctrl-C once the figure's first bytes are written: one line, exit status 130, the previous PNG
    byte for byte and no temporary left beside it."""
    import matplotlib.figure

    from graphormer_urpe.cli import plot

    metrics = tmp_path / "csv" / "version_0" / "metrics.csv"
    metrics.parent.mkdir(parents=True)
    metrics.write_text("epoch,step,train/loss\n0,0,1.0\n0,1,0.5\n")
    out = tmp_path / "curves.png"
    out.write_bytes(b"the previous figure")

    def interrupted(figure, handle, **kwargs):
        handle.write(b"\x89PNG, half of it")
        raise KeyboardInterrupt

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", interrupted)
    monkeypatch.setattr(sys, "argv", ["graphormer-urpe-plot", "curves", str(tmp_path), "-o", str(out)])
    assert plot.console_main() == 130
    assert capsys.readouterr().err == ("graphormer-urpe-plot: stopped by Ctrl-C (SIGINT); outputs not yet "
                                       "written are left as they were\n")
    assert out.read_bytes() == b"the previous figure"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["csv", "curves.png"]

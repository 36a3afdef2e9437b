"""The installed commands where the optional extras (``plot``: matplotlib, ``hpopt``: optuna,
``fused``: triton) are not installed: a ``sitecustomize`` on ``PYTHONPATH`` puts, in every process a
command starts, a copy of the environment's site-packages without those libraries (links to its
other entries: their code and their metadata gone, as in an environment that never had them) in
place of the real one. A command that needs an extra says which in one line with an install line
that works from a source checkout, exit status 2, no traceback; its ``--help`` works without it."""
from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
EXTRAS = {"matplotlib": "plot", "optuna": "hpopt", "triton": "fused"}


def is_blocked(entry: str) -> bool:
    """Whether a site-packages entry is one of :data:`EXTRAS`' libraries or its metadata."""
    return entry.split("-")[0].split(".")[0].lower() in EXTRAS


@pytest.fixture(scope="module")
def without_extras(tmp_path_factory):
    """``run(command, *args) -> CompletedProcess``: an installed command in an empty folder,
    the extras' libraries not installed."""
    root = tmp_path_factory.mktemp("no_extras")
    mirrors = {}
    for site in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        mirror = root / f"site{len(mirrors)}"
        mirror.mkdir()
        for entry in Path(site).iterdir():
            if not is_blocked(entry.name):
                (mirror / entry.name).symlink_to(entry)
        mirrors[site] = str(mirror)
    (root / "hook").mkdir()
    (root / "hook" / "sitecustomize.py").write_text(
        f"import sys\nMIRRORS = {mirrors!r}\nsys.path[:] = [MIRRORS.get(p, p) for p in sys.path]\n")
    folder = tmp_path_factory.mktemp("empty")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root / "hook"), os.environ.get("PYTHONPATH")]))}

    def run(command: str, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN / command), *args], capture_output=True, text=True, env=env,
                              cwd=folder, timeout=300)

    probe = subprocess.run([sys.executable, "-c", "import importlib.util as u, importlib.metadata as m\n"
                            f"for n in {list(EXTRAS)!r}:\n"
                            "    print(u.find_spec(n), n in {d.metadata['Name'] for d in m.distributions()})\n"
                            "import torch, lightning, graphormer_urpe"],
                            capture_output=True, text=True, env=env, cwd=folder)
    assert probe.returncode == 0 and probe.stdout.split() == ["None", "False"] * len(EXTRAS), probe.stderr[-2000:]
    return run, folder


def one_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stdout[-1000:] + result.stderr[-2000:]
    # Lightning's own log line of the fit command's seed comes first
    lines = [line for line in result.stderr.strip().splitlines() if not line.startswith("Seed set to ")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    return lines[0]


@pytest.mark.parametrize("command", ["graphormer-urpe-plot", "graphormer-urpe-hpopt", "graphormer-urpe"])
def test_help_works_without_the_extras(without_extras, command):
    run, _ = without_extras
    result = run(command, "--help")
    assert result.returncode == 0 and result.stdout.startswith("usage:"), result.stderr[-2000:]


def test_plot_without_matplotlib_names_its_extra(without_extras):
    run, folder = without_extras
    for args in (["curves", str(folder)], ["model.ckpt", "--out", "figs"]):
        assert one_line(run("graphormer-urpe-plot", *args)) == (
            "graphormer-urpe-plot: error: graphormer-urpe-plot needs matplotlib, which is not installed: "
            "pip install '.[plot]' in the source checkout, or pip install 'matplotlib>=3.7'")
    assert not (folder / "figs").exists()


def test_hpopt_without_optuna_names_its_extra(without_extras):
    run, folder = without_extras
    (folder / "space.yaml").write_text("model.lr: {type: float, low: 1.0e-5, high: 1.0e-3, log: true}\n")
    assert one_line(run("graphormer-urpe-hpopt", "--space", "space.yaml", "--config", "csv", "--n-trials", "1")) == (
        "graphormer-urpe-hpopt: error: graphormer-urpe-hpopt needs optuna, which is not installed: "
        "pip install '.[hpopt]' in the source checkout, or pip install 'optuna>=4.9'")
    assert not (folder / "runs").exists()


def test_the_triton_kernel_without_triton_names_its_extra(without_extras):
    run, folder = without_extras
    assert one_line(run("graphormer-urpe", "fit", "--config", "zinc", "--model.backbone.attention_impl", "triton",
                        "--trainer.default_root_dir", str(folder / "runs" / "k"))) == (
        "graphormer-urpe: error: --model.backbone.attention_impl triton needs triton, which is not installed: "
        "pip install '.[fused]' in the source checkout, or pip install 'triton>=3.4'")
    assert not (folder / "data").exists()

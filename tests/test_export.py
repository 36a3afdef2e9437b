"""``graphormer-urpe-export CHECKPOINT OUT`` (the export of a training checkpoint's
backbone), run as a command on a checkpoint trained on real ESOL molecules: it never writes over
its input, writes whole or not at all, and says every refusal in one line (exit status 2; 1 for
a full disk) with the files left as they were."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from graphormer_urpe.cli import export as export_command
from graphormer_urpe.prediction import pretrained
from graphormer_urpe.cli.fit import main as cli_main

REPO = Path(__file__).resolve().parents[1]
EXPORT = [str(Path(sys.executable).with_name("graphormer-urpe-export"))]
TINY = {"num_layers": 2, "hidden_dim": 16, "ffn_dim": 16, "num_heads": 2}
SHIPPED = pretrained.WEIGHTS_DIR / "zinc-descriptors.pt"


@pytest.fixture(scope="module")
def trained(esol_csv, tmp_path_factory) -> Path:
    """The ``last.ckpt`` of a tiny model fitted for 2 steps on ESOL by ``graphormer-urpe fit``."""
    work = tmp_path_factory.mktemp("export")
    assert cli_main(["fit", "--config", str(REPO / "configs" / "esol.yaml"),
                     "--trainer.default_root_dir", str(work / "run"), "--trainer.max_steps", "2",
                     "--trainer.limit_val_batches", "1", "--trainer.enable_progress_bar", "false",
                     "--trainer.enable_model_summary", "false", "--model.backbone", json.dumps(TINY),
                     "--model.warmup_steps", "1", "--data.init_args.path", str(esol_csv),
                     "--data.init_args.cache_root", str(work / "cache")]) == 0
    return work / "run" / "checkpoints" / "last.ckpt"


def export(*args, code: str | None = None) -> subprocess.CompletedProcess:
    """The export command (``code``: run first in its process, e.g. a patch that fills the disk)."""
    command = EXPORT if code is None else [
        sys.executable, "-c", f"{code}\nimport sys, runpy\nsys.argv = ['graphormer-urpe-export', *sys.argv[1:]]\n"
                              "runpy.run_module('graphormer_urpe.cli.export', run_name='__main__')"]
    return subprocess.run([*command, *map(str, args)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def assert_refused(done: subprocess.CompletedProcess, status: int, message: str) -> None:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == status and len(lines) == 1, done.stderr[-3000:]
    assert lines[0].startswith(f"{export_command.PROG}: error: ") and message in lines[0], lines[0]


def hidden_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_export_writes_the_backbone(trained, tmp_path):
    done = export(trained, tmp_path / "backbone.pt")
    assert done.returncode == 0, done.stderr[-3000:]
    content = torch.load(tmp_path / "backbone.pt", weights_only=True)
    assert len(content["state_dict"]) > 20 and "init_from" not in content["hyper_parameters"]
    assert hidden_files(tmp_path) == []


@pytest.mark.parametrize("spelling", ["same", "symlink", "hardlink"])
def test_export_onto_its_own_checkpoint_is_refused(trained, tmp_path, spelling):
    ckpt = tmp_path / "model.ckpt"
    ckpt.write_bytes(trained.read_bytes())
    before = digest(ckpt)
    out = {"same": ckpt, "symlink": tmp_path / "link.pt", "hardlink": tmp_path / "hard.pt"}[spelling]
    if spelling == "symlink":
        out.symlink_to(ckpt)
    elif spelling == "hardlink":
        os.link(ckpt, out)
    assert_refused(export(ckpt, out), 2, f"out {out} is the training checkpoint {ckpt} (checkpoint): it "
                                         "would be overwritten")
    assert digest(ckpt) == before and hidden_files(tmp_path) == []


@pytest.mark.parametrize("problem", ["missing", "directory", "csv", "exported backbone"])
def test_an_input_that_is_no_training_checkpoint_is_refused(problem, esol_csv, tmp_path):
    source, message = {"missing": (tmp_path / "nothing.ckpt", "does not exist"),
                       "directory": (tmp_path, "is a directory"),
                       "csv": (esol_csv, "cannot be read: not a PyTorch checkpoint archive"),
                       "exported backbone": (SHIPPED, "is not a training checkpoint: it has no model weights")}[problem]
    shipped = digest(SHIPPED)
    assert_refused(export(source, tmp_path / "out.pt"), 2, f"{source} {message}")
    assert not (tmp_path / "out.pt").exists() and digest(SHIPPED) == shipped


@pytest.mark.parametrize("problem", ["missing folder", "directory", "under a file"])
def test_an_output_that_cannot_be_written_is_refused(trained, tmp_path, problem):
    (tmp_path / "file").write_text("x")
    out, message = {"missing folder": (tmp_path / "no" / "out.pt", "its folder"),
                    "directory": (tmp_path, "is a directory"),
                    "under a file": (tmp_path / "file" / "out.pt", "its folder")}[problem]
    assert_refused(export(trained, out), 2, f"out {out}")
    assert message in export(trained, out).stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_a_full_disk_keeps_the_previous_file_whole(trained, tmp_path):
    """``torch.save`` writes part of the file and then fails as a full disk does: one line, exit
    status 1, the previous export byte for byte, no temporary file."""
    out = tmp_path / "backbone.pt"
    assert export(trained, out).returncode == 0
    previous = out.read_bytes()
    fill = ("import errno, torch\nsave = torch.save\n"
            "def full(obj, f, *a, **k):\n"
            "    f.write(b'half a file')\n"
            "    raise OSError(errno.ENOSPC, 'No space left on device')\n"
            "torch.save = full")
    assert_refused(export(trained, out, code=fill), 1, "No space left on device")
    assert out.read_bytes() == previous and hidden_files(tmp_path) == []


def test_a_previous_export_is_replaced(trained, tmp_path):
    out = tmp_path / "backbone.pt"
    out.write_bytes(SHIPPED.read_bytes())  # an export of this command
    done = export(trained, out)
    assert done.returncode == 0, done.stderr[-3000:]
    assert torch.load(out, weights_only=True)["trained"]["source"] == trained.name


@pytest.mark.parametrize("existing", ["another checkpoint of the run", "a data file"])
def test_an_existing_file_that_is_no_export_is_not_overwritten(trained, esol_csv, tmp_path, existing):
    """``out`` naming the run's best checkpoint (not the one exported) or a data file: one line,
    exit status 2, the file as it was."""
    out = tmp_path / "best.ckpt"
    out.write_bytes(trained.read_bytes() if existing == "another checkpoint of the run" else esol_csv.read_bytes())
    before = digest(out)
    assert_refused(export(trained, out), 2, f"out {out} exists and is not a backbone written by "
                                            "graphormer-urpe-export (it would be overwritten)")
    assert digest(out) == before and hidden_files(tmp_path) == []


def test_a_checkpoint_whose_weights_hold_nan_is_refused(trained, tmp_path):
    """Weights that predict refuses are not exported: one line naming the tensor, nothing written."""
    saved = torch.load(trained, weights_only=True)
    name = next(k for k, v in saved["state_dict"].items() if k.startswith("model.") and v.is_floating_point())
    saved["state_dict"][name][0] = float("nan")
    diverged = tmp_path / "diverged.ckpt"
    torch.save(saved, diverged)
    assert_refused(export(diverged, tmp_path / "out.pt"), 2,
                   f"checkpoint {diverged} has non-finite weights (NaN or inf) in 1 tensor(s): {name}")
    assert not (tmp_path / "out.pt").exists()

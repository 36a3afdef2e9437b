"""The built wheel is the whole product: built from the checkout's files as a fresh clone has them
(``pip wheel``, what ``python -m build --wheel`` runs), installed without ``-e`` into a fresh
virtual environment, its commands run from an empty folder and read nothing of the source tree.

The environment reuses the test environment's installed packages (torch, Lightning, RDKit...)
through a path in a ``.pth`` file, so nothing is downloaded but the build's own requirements; the
checkout's editable install there is not activated (a ``.pth`` path line does not process that
folder's own ``.pth`` files). An audit hook in the new environment logs every file or folder its
processes open or list under the checkout (the reused ``.venv`` aside): the log must stay empty.
The built wheel is kept in the test cache, keyed by the checkout's files, so a rerun without
changes installs it again without building it."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

REPO = Path(__file__).resolve().parents[1]
ESOL_TARGET = "measured log solubility in mols per litre"
#: Output of a build that failed for want of its requirements (setuptools, Cython, numpy) offline.
OFFLINE = ("No matching distribution found", "Failed to establish a new connection", "Network is unreachable",
           "Temporary failure in name resolution")
#: Logs what the new environment's processes open or list under the checkout (``GUARD_*`` unset: off).
GUARD = '''\
import os, sys
_root, _log = os.environ.get("GUARD_ROOT"), os.environ.get("GUARD_LOG")
if _root and _log:
    _allowed = tuple(p for p in os.environ.get("GUARD_ALLOWED", "").split(os.pathsep) if p)

    def _guard(event, args, root=_root + os.sep):
        if event in ("open", "os.listdir", "os.scandir") and args and isinstance(args[0], (str, bytes, os.PathLike)):
            path = os.path.abspath(os.fsdecode(args[0]))
            if (path + os.sep).startswith(root) and not path.startswith(_allowed):
                with open(_log, "a") as log:
                    log.write(f"{event} {path} (pid {os.getpid()})\\n")

    sys.addaudithook(_guard)
'''


def source_files() -> list[str]:
    """The checkout's files as a clone has them, plus new files git does not ignore."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                                cwd=REPO, capture_output=True, check=True, timeout=120).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"the checkout's files are listed by git, which failed here ({exc})")
    return sorted(name for name in listed.decode().split("\0") if name and os.path.lexists(REPO / name))


def copy_checkout(names: list[str], destination: Path) -> str:
    """Copy ``names`` (symbolic links as links) to ``destination``; the digest of what was copied."""
    digest = hashlib.sha256()
    for name in names:
        source, target = REPO / name, destination / name
        target.parent.mkdir(parents=True, exist_ok=True)
        digest.update(name.encode() + b"\0")
        if source.is_symlink():
            target.symlink_to(os.readlink(source))
            digest.update(os.readlink(source).encode())
        else:
            shutil.copy2(source, target)
            digest.update(source.read_bytes())
    return digest.hexdigest()[:16]


@pytest.fixture(scope="module")
def wheel(data_build_cache, tmp_path_factory) -> Path:
    """The wheel built from a copy of the checkout's files (once per content)."""
    source = tmp_path_factory.mktemp("clone")
    key = copy_checkout(source_files(), source)
    built = data_build_cache / f"wheel-{key}"
    if not built.is_dir():
        for old in data_build_cache.glob("wheel-*"):  # one kept: the newest checkout's
            shutil.rmtree(old, ignore_errors=True)
        partial = data_build_cache / f".wheel-{key}-{os.getpid()}"
        result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(partial),
                                 str(source)], capture_output=True, text=True, timeout=1200)
        if result.returncode != 0:
            shutil.rmtree(partial, ignore_errors=True)
            output = result.stdout + result.stderr
            if any(sign in output for sign in OFFLINE):
                pytest.skip("the wheel's build requirements (pyproject.toml's build-system) cannot be "
                            "downloaded here: " + output.strip().splitlines()[-1])
            pytest.fail(f"pip wheel failed:\n{output[-6000:]}")
        os.replace(partial, built)
    [found] = built.glob("graphormer_urpe-*.whl")
    return found


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> dict:
    """A fresh virtual environment with the wheel installed (no ``-e``, no dependencies: those come
    from this environment's packages), an empty folder to run in, and the environment variables
    its commands get."""
    root = tmp_path_factory.mktemp("wheel_env")
    env_dir = root / "env"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "zz_test_environment.pth").write_text("".join(f"{path}\n" for path in sorted(ours)))
    (site / "_checkout_guard.py").write_text(GUARD)
    (site / "_checkout_guard.pth").write_text("import _checkout_guard\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q",
                    str(wheel)], check=True, capture_output=True, timeout=600)
    work = root / "work"
    work.mkdir()
    environ = {name: value for name, value in os.environ.items()
               if name not in ("PYTHONPATH", "PYTHONHOME", "GRAPHORMER_URPE_DATA", "GRAPHORMER_URPE_SHARED_DATA",
                               "GRAPHORMER_URPE_ZINC_SOURCE", "VIRTUAL_ENV")}
    environ.update(PATH=f"{env_dir / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
                   XDG_CACHE_HOME=str(root / "cache"), OMP_NUM_THREADS="1",
                   GUARD_ROOT=str(REPO), GUARD_LOG=str(root / "read_from_checkout.log"),
                   GUARD_ALLOWED=os.pathsep.join(sorted(ours | {sys.prefix})))
    return {"bin": env_dir / "bin", "site": site, "work": work, "env": environ, "cache": root / "cache",
            "log": root / "read_from_checkout.log"}


def run(installed: dict, command: str, *args, expect: int = 0) -> subprocess.CompletedProcess:
    """One of the installed commands, run in the empty folder."""
    result = subprocess.run([str(installed["bin"] / command), *map(str, args)], cwd=installed["work"],
                            env=installed["env"], capture_output=True, text=True, timeout=900)
    assert result.returncode == expect, f"{command} {args}: exit {result.returncode}\n{result.stderr[-4000:]}"
    return result


def test_the_wheel_carries_the_recipes_the_encoder_and_the_backbone_and_no_checkout(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        recipes = {name.rsplit("/", 1)[1]: archive.read(name) for name in names
                   if name.startswith("graphormer_urpe/recipes/")}
    assert recipes == {path.name: path.read_bytes() for path in (REPO / "configs").glob("*.yaml")}
    assert "graphormer_urpe/pretrained/zinc-descriptors.pt" in names
    assert any(name.startswith("graphormer_urpe/data/_encoding") and name.endswith(".so") for name in names)
    assert not any(name.startswith(("tests/", "configs/", "scripts/", "docs/")) for name in names)


def test_the_installed_commands_work_from_an_empty_folder_without_the_checkout(installed, esol_csv):
    run(installed, "python", "-c", f"open({str(REPO / 'pyproject.toml')!r}).close()")  # the guard sees it
    assert installed["log"].read_text().startswith(f"open {REPO / 'pyproject.toml'} ")
    installed["log"].unlink()
    where = run(installed, "python", "-c", "import json, graphormer_urpe; from graphormer_urpe.data import "
                "local_data; print(json.dumps([graphormer_urpe.__file__, str(local_data.local_data_dir())]))")
    package, data_dir = json.loads(where.stdout)
    assert Path(package).is_relative_to(installed["site"])  # the wheel's, not the checkout's
    assert Path(data_dir) == installed["cache"] / "graphormer-urpe" / "data"

    listed = run(installed, "graphormer-urpe", "recipes").stdout
    names = [path.stem for path in sorted((REPO / "configs").glob("*.yaml"))]
    assert [line.split()[0] for line in listed.splitlines() if line.startswith("  ")] == names
    refused = run(installed, "graphormer-urpe", "fit", "--config", "configs/csv.yaml", expect=2)
    assert refused.stderr.count("\n") == 1 and "nor a recipe of that name (the recipes: compiled, csv" in refused.stderr

    # the README's fine-tuning command on a CSV of 48 real ESOL molecules, for three steps
    table = pd.read_csv(esol_csv).head(48).rename(columns={ESOL_TARGET: "my_target"})
    table[["smiles", "my_target"]].to_csv(installed["work"] / "my.csv", index=False)
    run(installed, "graphormer-urpe", "fit", "--config", "csv", "--data.init_args.path", "my.csv",
        "--data.init_args.smiles_column", "smiles", "--data.init_args.target_columns", "[my_target]",
        "--trainer.max_steps", "3", "--trainer.limit_val_batches", "1", "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false")
    checkpoint = installed["work"] / "runs" / "csv_finetune" / "checkpoints" / "last.ckpt"
    assert checkpoint.is_file() and (installed["work"] / "data" / "csv").is_dir()

    run(installed, "graphormer-urpe-predict", "--ckpt", checkpoint, "--input", "my.csv", "--output", "preds.csv")
    predictions = pd.read_csv(installed["work"] / "preds.csv")
    assert len(predictions) == 48 and np.isfinite(predictions["prediction_my_target"]).all()
    run(installed, "graphormer-urpe-predict", "--ckpt", "pretrained:zinc-descriptors", "--input", "my.csv",
        "--output", "descriptors.csv", "--embeddings", "my.npy")
    embeddings = np.load(installed["work"] / "my.npy")
    assert embeddings.shape == (48, 192) and np.isfinite(embeddings).all()

    for command in ("graphormer-urpe-ablation", "graphormer-urpe-hpopt", "graphormer-urpe-explain",
                    "graphormer-urpe-plot", "graphormer-urpe-submit", "graphormer-urpe-synthetic",
                    "graphormer-urpe-export"):
        assert run(installed, command, "--help").stdout.startswith(f"usage: {command}")
    log = installed["log"]
    assert not log.exists(), "read from the checkout:\n" + log.read_text()[:3000]

"""Where the local data copies are (``$GRAPHORMER_URPE_DATA``), and what the test suite does when a
data set is in none of them: skip with one line naming it and where to put it, or, with
``$GRAPHORMER_URPE_REQUIRE_DATA`` (CI), fail."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from graphormer_urpe.data import local_data
from graphormer_urpe.data.local_data import DATA_ENV, data_file, local_copy, local_data_dir
from helpers.read_only import read_only, writable_again  # noqa: F401 (a fixture)

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"
REQUIRE_DATA_ENV = "GRAPHORMER_URPE_REQUIRE_DATA"
FIT = str(Path(sys.executable).with_name("graphormer-urpe"))
TINY = json.dumps({"num_layers": 1, "hidden_dim": 16, "ffn_dim": 16, "num_heads": 2})
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def test_the_variable_names_the_directory_else_the_copy_beside_the_checkout(tmp_path, monkeypatch):
    monkeypatch.delenv(DATA_ENV, raising=False)
    monkeypatch.delenv("GRAPHORMER_URPE_SHARED_DATA", raising=False)
    monkeypatch.setattr(local_data, "CHECKOUT_COPY", tmp_path / "beside")
    assert local_data_dir() == tmp_path / "beside" and local_copy(local_data.ESOL) is None
    (tmp_path / "beside" / "moleculenet").mkdir(parents=True)
    (tmp_path / "beside" / "moleculenet" / "esol.csv").write_text("smiles\nCCO\n")
    assert local_copy(local_data.ESOL) == tmp_path / "beside" / "moleculenet" / "esol.csv"
    monkeypatch.setenv("GRAPHORMER_URPE_SHARED_DATA", str(tmp_path / "old"))  # the older name
    assert local_data_dir() == tmp_path / "old" and local_copy(local_data.ESOL) is None
    monkeypatch.setenv(DATA_ENV, str(tmp_path / "new"))  # wins over the older name
    assert local_data_dir() == tmp_path / "new"
    assert local_data.where_to_put(local_data.ZINC).startswith(f"{tmp_path / 'new' / 'zinc'} ($GRAPHORMER_URPE_DATA")


def test_a_missing_data_set_skips_in_one_line_or_fails_when_required(pytester, tmp_path, monkeypatch):
    """The suite's own conftest in a child session: the PCQM4Mv2 slice (which has no download)."""
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(test_needs_slice="def test_slice(pcqm_source):\n    assert pcqm_source.is_file()\n")
    copies = tmp_path / "copies"
    monkeypatch.setenv(DATA_ENV, str(copies))
    monkeypatch.delenv(REQUIRE_DATA_ENV, raising=False)
    expected = copies / local_data.PCQM4MV2_SLICE
    result = pytester.runpytest("-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines([f"SKIPPED * missing the PCQM4Mv2 slice; expected at {expected} *"])
    monkeypatch.setenv(REQUIRE_DATA_ENV, "1")  # as .ci/run sets it
    result = pytester.runpytest()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines([f"missing the PCQM4Mv2 slice; expected at {expected} *"])
    expected.parent.mkdir(parents=True)
    expected.write_bytes(b"")
    pytester.runpytest().assert_outcomes(passed=1)


def test_data_fixtures_work_without_pytests_cache_plugin(pytester):
    """``pytest -p no:cacheprovider`` (no ``config.cache``): the suite's conftest in a child session
    keeps long data builds in the same folder as with the plugin."""
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(test_cache_folder=(
        "def test_folder(data_build_cache, pytestconfig):\n"
        "    assert data_build_cache == pytestconfig.rootpath / '.pytest_cache' / 'd' / 'graphormer_urpe_datasets'\n"
        "    assert data_build_cache.is_dir()\n"))
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=1)
    pytester.runpytest().assert_outcomes(passed=1)


def test_a_recipes_data_file_is_the_local_copy_else_the_cache_else_downloaded_once(tmp_path, monkeypatch,
                                                                                 esol_csv):
    """``data:moleculenet/esol.csv`` (the ESOL recipes' path) from any folder: the local copy, else
    the user's data cache, filled by one download (here the real file through a ``file:`` URL)."""
    copies, cache = tmp_path / "copies", tmp_path / "cache"
    monkeypatch.setenv(DATA_ENV, str(copies))
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(local_data.DOWNLOADS, local_data.ESOL, esol_csv.as_uri())
    downloaded = data_file("data:moleculenet/esol.csv")
    assert downloaded == cache / "graphormer-urpe" / "data" / "moleculenet" / "esol.csv"
    assert downloaded.read_bytes() == esol_csv.read_bytes()
    assert sorted(p.name for p in downloaded.parent.iterdir()) == ["esol.csv"]  # nothing partial left
    monkeypatch.setitem(local_data.DOWNLOADS, local_data.ESOL, (tmp_path / "gone.csv").as_uri())
    assert data_file("data:moleculenet/esol.csv") == downloaded  # once: the cache serves it now
    (copies / "moleculenet").mkdir(parents=True)
    (copies / "moleculenet" / "esol.csv").write_bytes(esol_csv.read_bytes()[:2000])
    assert data_file("data:moleculenet/esol.csv") == copies / "moleculenet" / "esol.csv"
    assert data_file("moleculenet/esol.csv") == Path("moleculenet/esol.csv")  # a path is a path
    monkeypatch.delenv(DATA_ENV)
    monkeypatch.setattr(local_data, "IN_CHECKOUT", False)  # an installed package: the cache
    assert local_data_dir() == cache / "graphormer-urpe" / "data"


def test_a_data_file_that_no_copy_holds_is_refused_in_one_line(tmp_path, monkeypatch, run_main):
    copies, cache = tmp_path / "copies", tmp_path / "cache"
    monkeypatch.setenv(DATA_ENV, str(copies))
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    with pytest.raises(ValueError, match=r"^data:zinc/jtvae_train.smi.gz: no local copy of zinc/jtvae_train"
                                         rf".smi.gz; expected at {copies}/zinc/jtvae_train.smi.gz \(\$GRAPHORMER"):
        data_file("data:zinc/jtvae_train.smi.gz")
    gone = (tmp_path / "gone.csv").as_uri()
    monkeypatch.setitem(local_data.DOWNLOADS, local_data.ESOL, gone)
    monkeypatch.chdir(tmp_path)
    from graphormer_urpe.cli.fit import main

    done = run_main(main, ["fit", "--config", "esol", "--trainer.default_root_dir", tmp_path / "run"])
    lines = done.stderr.strip().splitlines()  # after Lightning's seeding note: the one line
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert [line for line in lines if line.startswith("graphormer-urpe: error: ")] == lines[-1:]
    assert lines[-1].startswith("graphormer-urpe: error: data:moleculenet/esol.csv: no local copy of "
                                f"moleculenet/esol.csv (expected at {copies}/moleculenet/esol.csv")
    assert f"its download from {gone} to {cache}/graphormer-urpe/data/moleculenet/esol.csv failed" in lines[-1]
    assert not (cache / "graphormer-urpe" / "data" / "moleculenet").exists() or \
        not any((cache / "graphormer-urpe" / "data" / "moleculenet").iterdir())


def in_folder(folder: Path, command: list[str]) -> list[str]:
    """``command`` started in ``folder`` (after :func:`read_only` made it read-only, so that the
    folder it runs in is the read-only one)."""
    return ["sh", "-c", 'cd "$1" && shift && exec "$@"', "sh", str(folder), *command]


@pytest.mark.parametrize("recipe, option, root", [("esol", "--data.init_args.cache_root", "data/csv"),
                                                  ("zinc", "--data.init_args.root", "data")])
def test_a_data_root_that_cannot_be_written_is_one_line(esol_csv, tmp_path, writable_again, recipe, option, root):
    """The installed command run in a read-only folder, where the data is built under ``data/`` by
    default: one line naming the folder and the option that moves it, exit status 2."""
    work = tmp_path / "work"
    work.mkdir()
    command = [FIT, "fit", "--config", recipe, "--trainer.default_root_dir", str(tmp_path / "run"),
               "--trainer.max_steps", "1", "--model.warmup_steps", "0"]
    if recipe == "esol":
        command += ["--data.init_args.path", str(esol_csv)]
    done = subprocess.run(read_only([work], in_folder(work, command)), env=ENV, capture_output=True,
                          text=True, timeout=600)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert [line for line in lines if "error" in line] == lines[-1:]
    assert lines[-1].startswith(f"graphormer-urpe: error: {option} {root} cannot be written (") and \
        lines[-1].endswith(f"): the data is built there; choose a folder that can be written with {option}"), lines[-1]
    assert list(work.iterdir()) == []


def test_a_read_only_data_root_that_holds_the_built_data_is_read(zinc_data_root, zinc_root, tmp_path_factory,
                                                                 writable_again):
    """ZINC built and encoded already: its read-only root trains as a writable one does."""
    from graphormer_urpe.data.zinc import ZINCDataModule

    ZINCDataModule(root=str(zinc_data_root), max_hops=5).prepare_data()  # the encodings this fit reads
    command = [FIT, "fit", "--config", "zinc", "--data.init_args.root", str(zinc_data_root),
               "--data.init_args.max_hops", "5", "--trainer.default_root_dir", str(tmp_path_factory.mktemp("run")),
               "--trainer.max_steps", "1", "--model.warmup_steps", "0", "--trainer.precision", "32-true",
               "--trainer.limit_val_batches", "1", "--trainer.enable_progress_bar", "false",
               "--model.backbone", TINY]
    mode = zinc_root.stat().st_mode
    try:
        done = subprocess.run(read_only([zinc_data_root, zinc_root], command), env=ENV, capture_output=True,
                              text=True, timeout=600)
    finally:
        zinc_root.chmod(mode)  # the session's ZINC, which a user other than root made read-only
    assert done.returncode == 0, done.stderr[-3000:]

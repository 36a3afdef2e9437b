"""Where the local data copies are (``$GRAPHORMER_URPE_DATA``), and what the test suite does when a
data set is in none of them: skip with one line naming it and where to put it, or, with
``$GRAPHORMER_URPE_REQUIRE_DATA`` (CI), fail."""
from __future__ import annotations

from pathlib import Path

from graphormer_urpe.data import local_data
from graphormer_urpe.data.local_data import DATA_ENV, local_copy, local_data_dir

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"
REQUIRE_DATA_ENV = "GRAPHORMER_URPE_REQUIRE_DATA"


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

"""The ablation runner's promises at its edges, through the installed command on the real
ZINC-12k (tiny budget): every output checked against every input and the other outputs, bad
files and options refused in one line before any work, the README's blocks from every run of
the grid on disk (several invocations, one per GPU), the user's README edits kept, and a stop
while the data is built said in one line."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.processes import children, group_is_gone
from test_ablation import REPO, runner_command

INSTALLED = str(Path(sys.executable).parent / "graphormer-urpe-ablation")
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
#: Four steps: runs of the grid that end in seconds.
SHORT = ("--trainer.max_steps", "4", "--model.total_steps", "4", "--model.warmup_steps", "1")
README = ("# Results\n\nThe user's text.\n\n<!-- ablation:tiny -->\n<!-- /ablation:tiny -->\n\n"
          "<!-- ablation-progress:tiny -->\n<!-- /ablation-progress:tiny -->\n\nMore of it.\n")


def installed(tmp_path: Path, data_root: Path, *extra: str) -> list[str]:
    """The test grid's command (:func:`test_ablation.runner_command`) as the console script."""
    return [INSTALLED, *runner_command(tmp_path, data_root, *extra)[3:]]


def run(command: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout)


def refused(done: subprocess.CompletedProcess) -> str:
    """The one line of a refusal (exit status 2, nothing else on stderr)."""
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-3000:]
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("graphormer-urpe-ablation: error: "), line
    return line.removeprefix("graphormer-urpe-ablation: error: ")


def contents(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def chattr_immutable():
    """``make(path)``: ``path`` made immutable (``chattr +i``: not even root may replace or write
    it), undone after the test; skips where the file system or the user cannot."""
    made = []

    def make(path: Path) -> None:
        done = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"chattr +i is not permitted here: {done.stderr.strip()}")
        made.append(path)

    yield make
    for path in made:
        subprocess.run(["chattr", "-i", str(path)], check=True)


# --------------------------------------------------------------------------------------------
# Outputs against inputs and each other
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("outputs, message", [
    (["--table", "{results}"], "--table {results} is the results file {results} (--results)"),
    (["--table", "{config}"], "--table {config} is the recipe config {config} (--config)"),
    (["--table", "{readme}", "--readme", "{readme}"], "--readme {readme} is the table {readme} (--table)"),
    (["--readme", "{config_link}"], "--readme {config_link} is the recipe config {config} (--config)"),
    (["--table", "{readme_hard_link}", "--readme", "{readme}"],
     "--readme {readme} is the table {readme_hard_link} (--table)"),
    (["--table", "{tmp}/sub/../README.md", "--readme", "{readme}"],
     "--readme {readme} is the table {tmp}/sub/../README.md (--table)"),
    (["--results", "{tmp}/results.md"], "the default --table {tmp}/results.md is the results file "
                                        "{tmp}/results.md (--results)"),
    (["--figures", "{tmp}", "--readme", "{tmp}/tiny-tables.png"],
     "--figures {tmp}/tiny-tables.png is the README {tmp}/tiny-tables.png (--readme)"),
    (["--table-only", "--name", "tiny", "--table", "{results}"],
     "--table {results} is the results file {results} (--results)"),
])
def test_an_output_that_is_an_input_or_another_output_is_refused_before_any_work(
        zinc_data_root, tmp_path, outputs, message):
    """However spelled (a symbolic or hard link, ``..``): one line, exit 2, every file as it was,
    no run directory."""
    config = tmp_path / "recipe.yaml"
    config.write_text((REPO / "configs" / "zinc.yaml").read_text())
    (tmp_path / "recipe-link.yaml").symlink_to(config)
    readme = tmp_path / "README.md"
    readme.write_text(README)
    os.link(readme, tmp_path / "README-hard.md")
    (tmp_path / "sub").mkdir()
    results = tmp_path / "results.json"
    results.write_text(json.dumps([{"recipe": "tiny", "attention": "urpe", "seed": 0, "steps": 4,
                                    "val_mae": 1.0, "test_mae": 1.0, "wall_s": 1.0, "device": "x",
                                    "commit": "c"}]))
    names = {"results": results, "config": config, "readme": readme, "tmp": tmp_path,
             "config_link": tmp_path / "recipe-link.yaml", "readme_hard_link": tmp_path / "README-hard.md"}
    before = contents(tmp_path)
    command = installed(tmp_path, zinc_data_root, *(a.format(**names) for a in outputs))
    command[command.index("--config") + 1] = str(config)
    line = refused(run(command))
    assert line == message.format(**names) + ": it would be overwritten; choose another output"
    assert contents(tmp_path) == before and not (tmp_path / "runs").exists()


# --------------------------------------------------------------------------------------------
# Files that cannot be read or written, records that are not records
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["results is a folder", "table is a folder", "figures is a file",
                                  "immutable table", "immutable README", "immutable figures folder"])
def test_an_output_that_cannot_be_written_is_refused_before_any_work(zinc_data_root, tmp_path,
                                                                     chattr_immutable, case):
    readme, table, folder = tmp_path / "README.md", tmp_path / "table.md", tmp_path / "figures"
    readme.write_text(README)
    table.write_text("the previous table\n")
    folder.mkdir()
    option, path, why = {
        "results is a folder": ("--results", folder, "is a directory; name the file to write"),
        "table is a folder": ("--table", folder, "is a directory; name the file to write"),
        "figures is a file": ("--figures", table, "cannot be written (File exists)"),
        "immutable table": ("--table", table, "cannot be written (Operation not permitted)"),
        "immutable README": ("--readme", readme, "cannot be written (Operation not permitted)"),
        "immutable figures folder": ("--figures", folder, "cannot be written (Operation not permitted)"),
    }[case]
    if case.startswith("immutable"):
        chattr_immutable(path)
    extra = [option, str(path)] + (["--readme", str(readme)] if option != "--readme" else [])
    before = contents(tmp_path)
    assert refused(run(installed(tmp_path, zinc_data_root, *extra))) == f"{option} {path} {why}"
    assert contents(tmp_path) == before and not (tmp_path / "runs").exists()


def test_a_readme_that_is_not_utf8_is_named(zinc_data_root, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_bytes(README.replace("user's", "user\xe9s").encode("latin-1"))
    line = refused(run(installed(tmp_path, zinc_data_root, "--readme", str(readme))))
    assert line == f"{readme}: not UTF-8 text (invalid continuation byte at byte 19); save it as UTF-8"
    assert not (tmp_path / "runs").exists()


def test_a_study_database_that_is_not_one_is_refused_before_any_work(zinc_data_root, tmp_path):
    """The grid's ``study.db`` (its runs' trials and results) damaged: one line naming it, before
    any run; the file is kept."""
    path = tmp_path / "runs" / "tiny" / "study.db"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a database, but the user's bytes")
    line = refused(run(installed(tmp_path, zinc_data_root, "--arms", "rpe")))
    assert line.startswith(f"--runs-dir sqlite:///{path}: cannot open the study database (DatabaseError: "), line
    assert path.read_bytes() == b"not a database, but the user's bytes"
    assert not (tmp_path / "runs" / "tiny" / "rpe-s0" / "fit.log").exists()


def test_a_damaged_checkpoint_the_progress_table_reads_is_refused_before_any_work(zinc_data_root, tmp_path):
    """An unfinished run of another invocation whose last.ckpt is damaged: with --readme its
    progress row reads it, so it is named before this invocation builds its data."""
    other = tmp_path / "runs" / "tiny" / "rpe-s3"
    (other / "checkpoints").mkdir(parents=True)
    (other / "checkpoints" / "last.ckpt").write_bytes(b"PK\x03\x04 not a checkpoint")
    readme = tmp_path / "README.md"
    readme.write_text(README)
    data_root = tmp_path / "not built"
    line = refused(run(installed(tmp_path, zinc_data_root, "--arms", "rpe", "--readme", str(readme),
                                 "--data.init_args.root", str(data_root))))
    assert line.startswith(f"checkpoint {other / 'checkpoints' / 'last.ckpt'} ")
    assert readme.read_text() == README and not data_root.exists()


# --------------------------------------------------------------------------------------------
# Several invocations, one README
# --------------------------------------------------------------------------------------------
def progress_rows(readme: Path) -> list[str]:
    block = readme.read_text().split("<!-- ablation-progress:tiny -->")[1].split("<!-- /ablation-progress:tiny -->")[0]
    return [line for line in block.splitlines() if line.startswith("| rpe-")]


@pytest.mark.slow
def test_invocations_of_one_grid_each_show_every_run_on_disk(zinc_data_root, tmp_path):
    """The several-GPU way: two invocations at once with their own --seeds and the same --name,
    --results and --readme. Whichever ends last, the README's progress block and the results
    hold both runs; a later invocation of one seed (nothing left to do) still shows both, even
    where the other's finished run has lost its last.ckpt's content (its result says it)."""
    readme = tmp_path / "README.md"
    readme.write_text(README)
    commands = [installed(tmp_path, zinc_data_root, "--arms", "rpe", "--seeds", str(seed), "--readme",
                          str(readme), *SHORT) for seed in (0, 1)]
    grids = [subprocess.Popen(command, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for command in commands]
    for grid in grids:
        output = grid.communicate(timeout=600)[0]
        assert grid.returncode == 0, output[-3000:]
    rows = progress_rows(readme)
    assert [row.split(" | ")[:2] for row in rows] == [["| rpe-s0", "4 (done)"], ["| rpe-s1", "4 (done)"]], rows
    results = json.loads((tmp_path / "results.json").read_text())
    assert sorted(e["seed"] for e in results) == [0, 1]
    text = readme.read_text()
    assert "| rpe | 2 | 0, 1 | 4 |" in text and "The user's text." in text and text.endswith("More of it.\n")

    (tmp_path / "runs" / "tiny" / "rpe-s1" / "checkpoints" / "last.ckpt").write_bytes(b"damaged")
    (tmp_path / "results.json").write_text(json.dumps([e for e in results if e["seed"] == 0]))
    again = run(commands[0])
    assert again.returncode == 0 and "Traceback" not in again.stderr, again.stderr[-3000:]
    assert ": fit" not in again.stdout
    assert progress_rows(readme) == rows
    assert sorted(e["seed"] for e in json.loads((tmp_path / "results.json").read_text())) == [0, 1]


@pytest.mark.slow
def test_readme_edits_made_while_the_grid_runs_are_kept(zinc_data_root, tmp_path):
    """The README is read when its blocks are written: text the user adds meanwhile stays, and a
    block whose markers the user removed is said in one line (exit 1) while the rest is written."""
    readme = tmp_path / "README.md"
    readme.write_text(README)
    command = installed(tmp_path, zinc_data_root, "--arms", "rpe", "--readme", str(readme), *SHORT)
    grid = subprocess.Popen(command, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    fit_log = tmp_path / "runs" / "tiny" / "rpe-s0" / "fit.log"
    deadline = time.monotonic() + 300
    while not fit_log.exists() and grid.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    edited = (README.replace("The user's text.", "The user's text, edited while it ran.")
              .replace("<!-- ablation-progress:tiny -->\n<!-- /ablation-progress:tiny -->\n", "") + "Added.\n")
    readme.write_text(edited)
    out, err = grid.communicate(timeout=600)
    assert grid.returncode == 1, out[-2000:] + err[-3000:]
    assert err.strip().splitlines()[-1] == (
        f"graphormer-urpe-ablation: error: {readme} needs one line <!-- ablation-progress:tiny --> and, "
        "after it, one line <!-- /ablation-progress:tiny --> where the table belongs")
    text = readme.read_text()
    head, rest = text.split("<!-- ablation:tiny -->\n")
    assert head == edited.split("<!-- ablation:tiny -->\n")[0]
    assert "| rpe | 1 | 0 | 4 |" in rest and rest.endswith("<!-- /ablation:tiny -->\n\n\nMore of it.\nAdded.\n")
    assert json.loads((tmp_path / "results.json").read_text())[0]["steps"] == 4


# --------------------------------------------------------------------------------------------
# A stop while the data is built
# --------------------------------------------------------------------------------------------
def open_files(pid: int) -> list[str]:
    """What the process's file descriptors name (none once it has ended)."""
    try:
        return [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
    except OSError:
        return []


@pytest.mark.parametrize("signum, status, name", [(signal.SIGTERM, 143, "SIGTERM"), (signal.SIGINT, 130, "SIGINT")])
def test_a_stop_while_the_data_is_built_is_one_line(zinc_source, tmp_path, signum, status, name):
    """A signal to the runner (SIGTERM: a scheduler; SIGINT: Ctrl-C, which the terminal sends to
    the whole group) while its run's fit and the fit's worker processes build ZINC: the one line
    and its exit status, no traceback from the runner or in the fit's log, no process left
    running, and none but the runner holds a run directory's lock."""
    from graphormer_urpe.utils.process import usable_cores

    if usable_cores() < 2:
        pytest.skip("the data is built without a worker pool on one core")
    command = installed(tmp_path, tmp_path / "data", "--arms", "rpe")
    runner = subprocess.Popen(command, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True)

    def descendants(pid: int) -> list[int]:
        return [p for child in children(pid) for p in (child, *descendants(child))]

    deadline = time.monotonic() + 300
    while runner.poll() is None and len(descendants(runner.pid)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (tmp_path / "data" / "ZINC").exists(), "the data was not being built"
    held = [path for process in descendants(runner.pid) for path in open_files(process)]
    assert held and not [path for path in held if path.endswith("ablation.lock")], held  # the runner's alone
    if signum == signal.SIGINT:
        os.killpg(runner.pid, signum)
    else:
        runner.send_signal(signum)
    out, err = runner.communicate(timeout=300)
    assert runner.returncode == status, out[-2000:] + err[-3000:]
    assert group_is_gone(runner.pid), "a process outlived the runner"
    assert "Traceback" not in err and "Stopped" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == (f"graphormer-urpe-ablation: stopped by {name}; every run keeps "
                                            "its last.ckpt: the same command continues")
    assert "Traceback" not in (tmp_path / "runs" / "tiny" / "rpe-s0" / "fit.log").read_text()

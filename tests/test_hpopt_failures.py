"""graphormer-urpe-hpopt when things go wrong, through the installed command on real ESOL (a
tiny model, 4 steps a trial, as tests/test_hpopt.py): a diverged trial is pruned with its reason,
never complete; a search space, a study name or a recipe that fit would refuse is one line before
any trial; workers started together on a new study all run; a read-only study is one line; a
study database locked during a trial and a SIGTERM to the search each end in one line naming the
trial, and the same command run again fails that trial and runs its values again."""
from __future__ import annotations

import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import optuna
import pytest
import yaml

from graphormer_urpe.training.studies.search import BEST_CONFIG, DIVERGED_MARKER, FIT_LOG
from graphormer_urpe.training.studies.study import STUDY_DB
from helpers.read_only import read_only, writable_again  # noqa: F401 (a fixture)
from test_hpopt import ENV, REPO, hpopt_command, refused, run, trials

#: model.lr so large that the first steps make the model's outputs non-finite.
DIVERGING = {"model.lr": {"type": "float", "low": 1e8, "high": 1e9, "log": True}}
#: Generous: these tests must pass with the CPU busy with other work.
WAIT_S = 600


def start(command: list[str]) -> subprocess.Popen:
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=REPO)


def wait_for_fit(log: Path, search: subprocess.Popen) -> None:
    """Until the trial's fit has started training (or the search ended)."""
    deadline = time.monotonic() + WAIT_S
    while not (log.is_file() and "Seed set" in log.read_text()):
        assert search.poll() is None, search.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"no fit started in {log}"
        time.sleep(0.2)


def processes_running(word: str) -> list[int]:
    """The processes whose command line holds ``word``."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and word in (proc / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


# ---------------------------------------------------------------- diverged trials


@pytest.mark.parametrize("where", ["validation", "training"])
def test_a_diverged_trial_is_pruned_with_its_reason_never_complete(esol_csv, tmp_path, where):
    """Non-finite validation outputs (the trial's fit stops there, before any checkpoint), or a
    fit that stops because every step of a logging interval had a non-finite loss: the trial is pruned with the reason, has
    no value, and best.yaml is not written from it."""
    extra = ["--trainer.log_every_n_steps", "1"] if where == "training" else []
    done = run(hpopt_command(tmp_path, esol_csv, "--n-trials", "1", *extra, space=DIVERGING))
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1].startswith("graphormer-urpe-hpopt: error: no complete trial yet")
    (trial,) = trials(tmp_path)
    assert trial.state == optuna.trial.TrialState.PRUNED and trial.value is None
    reason = trial.user_attrs["reason"]
    assert reason.startswith("diverged: ")
    run_dir = tmp_path / "runs" / "esol" / "trial-0"
    marker = yaml.safe_load((run_dir / DIVERGED_MARKER).read_text())
    if where == "validation":  # the fit stops at the validation, before its value is reported
        assert "validation outputs are not finite after step" in reason and "(validation mae: nan)" in reason
        assert marker["validation"] is None and not trial.intermediate_values
    else:
        assert "non-finite loss or gradient" in reason and marker["validation"] is None
    assert f"trial 0: {reason}" in done.stdout
    assert "complete" not in done.stdout and "inf" not in done.stdout
    assert not (tmp_path / "runs" / "esol" / BEST_CONFIG).exists()


# ---------------------------------------------------------------- refused before any trial


def refused_space(tmp_path: Path, esol_csv: Path, text: str, *extra: str) -> str:
    (tmp_path / "bad-space.yaml").write_text(text)
    command = hpopt_command(tmp_path, esol_csv, "--n-trials", "1", *extra)
    command[command.index("--space") + 1] = str(tmp_path / "bad-space.yaml")
    line = refused(command, work=tmp_path)
    assert not (tmp_path / "runs" / "esol" / STUDY_DB).exists()
    return line


SPACE_REFUSALS = {
    "an infinite choice": ("model.lr: {type: float, low: 1.0e-4, high: 1.0e-3}\n"
                           "model.backbone.dropout: {type: categorical, choices: [0.0, .inf]}\n",
                           "line 2: model.backbone.dropout: choices must be finite numbers, strings, "
                           "booleans or null, got inf"),
    "a NaN choice": ("model.backbone.dropout:\n  type: categorical\n  choices: [.nan, 0.1]\n",
                     "line 1: model.backbone.dropout: choices must be finite numbers, strings, "
                     "booleans or null, got nan"),
    "a key written twice": ("model.lr: {type: float, low: 1.0e-4, high: 1.0e-3}\n"
                            "model.backbone.dropout: {type: categorical, choices: [0.0]}\n"
                            "model.lr: {type: float, low: 1.0e-5, high: 1.0e-3}\n",
                            "line 3: model.lr is written twice (first on line 1; YAML would keep only "
                            "the last): write it once"),
    "a field written twice": ("model.lr:\n  type: float\n  low: 1.0e-4\n  high: 1.0e-3\n  low: 1.0e-5\n",
                              "line 5: model.lr: field 'low' is written twice (first on line 3; YAML "
                              "would keep only the last): write it once"),
    "an infinite bound": ("model.lr: {type: float, low: 1.0e-4, high: .inf}\n",
                          "line 1: model.lr: high must be a finite number, got inf"),
}


@pytest.mark.parametrize("problem", SPACE_REFUSALS)
def test_a_bad_search_space_is_one_line_naming_the_file_the_line_and_the_key(esol_csv, tmp_path, problem):
    text, message = SPACE_REFUSALS[problem]
    line = refused_space(tmp_path, esol_csv, text)
    assert line == f"graphormer-urpe-hpopt: error: --space {tmp_path / 'bad-space.yaml'}, {message}"


def test_values_fit_refuses_are_one_line_before_any_trial(esol_csv, tmp_path):
    """fit's own checks (made before it reads data) on both ends of every range and on the
    recipe: a learning rate range that reaches below 0, a zero step budget."""
    line = refused_space(tmp_path, esol_csv, "model.backbone.dropout: {type: categorical, choices: [0.0]}\n"
                                             "model.lr: {type: float, low: -1.0e-3, high: 1.0e-3}\n")
    assert line == (f"graphormer-urpe-hpopt: error: --space {tmp_path / 'bad-space.yaml'}, line 2: model.lr: "
                    "-0.001 is not accepted by graphormer-urpe fit: model.lr must be > 0, got -0.001")
    line = refused(hpopt_command(tmp_path, esol_csv, "--n-trials", "1", "--trainer.max_steps", "0"),
                   work=tmp_path)
    assert line == ("graphormer-urpe-hpopt: error: the recipe (--config files and overrides) is not accepted "
                    "by graphormer-urpe fit: trainer.max_steps must be >= 1, or -1 for no limit, got 0")
    assert not (tmp_path / "runs" / "esol" / STUDY_DB).exists()


@pytest.mark.parametrize("name", ["..", ".", "", "a/b", "../elsewhere"])
def test_a_study_name_is_a_plain_name(esol_csv, tmp_path, name):
    command = hpopt_command(tmp_path, esol_csv, "--n-trials", "1")
    command[command.index("--study") + 1] = name
    line = refused(command, work=tmp_path)
    assert line.startswith("graphormer-urpe-hpopt: error: --study must be a plain name") and repr(name) in line
    assert not (tmp_path / "runs").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["space.yaml"]


# ---------------------------------------------------------------- several workers


def test_workers_started_together_on_a_new_study_all_run(esol_csv, tmp_path):
    """Rounds of workers started at once on a new SQLite study: none is refused (the database's
    tables are created by one of them while the others wait). In the first round two workers
    each run a trial; in the others three open the study and start no trial (--timeout)."""
    for round_ in range(5):
        work = tmp_path / f"round-{round_}"
        work.mkdir()
        extra, workers = (["--n-trials", "1"], 2) if round_ == 0 else (["--timeout", "0.001"], 3)
        command = hpopt_command(work, esol_csv, *extra)
        searches = [start(command) for _ in range(workers)]
        ended = [search.communicate(timeout=WAIT_S) for search in searches]
        for search, (out, err) in zip(searches, ended):
            assert "Traceback" not in err and "cannot open" not in err, f"round {round_}: {err[-3000:]}"
            assert out.startswith("study 'esol' ("), f"round {round_}: {out[-2000:]} {err[-3000:]}"
            if round_ == 0:
                assert search.returncode == 0, err[-3000:]
            else:
                assert search.returncode == 1 and err.strip().splitlines() == [
                    "graphormer-urpe-hpopt: error: no complete trial yet; see the trials' fit.log under "
                    f"{work / 'runs' / 'esol'}"], err[-3000:]
        states = [t.state for t in trials(work)]
        assert states == ([optuna.trial.TrialState.COMPLETE] * 2 if round_ == 0 else []), f"round {round_}"


# ---------------------------------------------------------------- a read-only study


@pytest.mark.parametrize("what", ["runs-dir", "study folder", "study database"])
def test_a_read_only_study_is_one_line_before_any_trial(esol_csv, tmp_path, what, writable_again):
    """A new study under a read-only --runs-dir, a study folder or a study database that
    cannot be written: one line naming the path, exit status 2, the database unchanged."""
    runs, study_dir = tmp_path / "runs", tmp_path / "runs" / "esol"
    runs.mkdir()
    database = study_dir / STUDY_DB
    if what != "runs-dir":
        study_dir.mkdir()
        optuna.create_study(study_name="esol", storage=f"sqlite:///{database}")
    before = database.read_bytes() if database.exists() else None
    locked = {"runs-dir": runs, "study folder": study_dir, "study database": database}[what]
    line = refused(read_only([locked], hpopt_command(tmp_path, esol_csv, "--n-trials", "1")), work=tmp_path)
    assert line.startswith(f"graphormer-urpe-hpopt: error: the {what if what != 'runs-dir' else 'study folder'} "
                           f"{database if what == 'study database' else study_dir} cannot be written ("), line
    assert str(locked) in line
    assert (database.read_bytes() if database.exists() else None) == before


# ---------------------------------------------------------------- a locked study, a stopped search


def test_a_study_locked_during_a_trial_ends_in_one_line_and_the_trial_runs_again(esol_csv, tmp_path):
    """Another program holds the study database locked from the trial's start until the search
    gives up: the fit goes on without reporting, the search says in one line that the database
    failed and which trial is left running; once the lock is gone, the same command fails that
    trial and runs its values again."""
    command = hpopt_command(tmp_path, esol_csv, "--n-trials", "1")
    search = start(command)
    wait_for_fit(tmp_path / "runs" / "esol" / "trial-0" / FIT_LOG, search)
    holder = sqlite3.connect(tmp_path / "runs" / "esol" / STUDY_DB, timeout=60, isolation_level=None)
    try:
        holder.execute("BEGIN EXCLUSIVE")
        out, err = search.communicate(timeout=WAIT_S)
    finally:
        holder.close()
    lines = err.strip().splitlines()
    assert search.returncode == 1 and len(lines) == 1, err[-3000:]
    assert lines[0].startswith(f"graphormer-urpe-hpopt: error: the study database sqlite:///{tmp_path}"), lines
    assert "database is locked" in lines[0] and "trial 0 is left running" in lines[0], lines
    assert "could not be reported to the study" in (tmp_path / "runs" / "esol" / "trial-0" / FIT_LOG).read_text()
    (left,) = trials(tmp_path)
    assert left.state == optuna.trial.TrialState.RUNNING

    resumed = run(command)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert "trial 0: its worker on this machine is gone; marked failed" in resumed.stdout
    failed, rerun = trials(tmp_path)
    assert failed.state == optuna.trial.TrialState.FAIL
    assert rerun.state == optuna.trial.TrialState.COMPLETE and rerun.params == left.params


def test_sigterm_stops_the_search_in_one_line_naming_the_trial_and_how_to_resume(esol_csv, tmp_path):
    """SIGTERM to the search during its first trial: the trial's fit ends, the trial is marked
    failed and its values queued; the last line says so and how to resume, exit status 143;
    the same command runs the queued values."""
    command = hpopt_command(tmp_path, esol_csv, "--n-trials", "1")
    search = start(command)
    run_dir = tmp_path / "runs" / "esol" / "trial-0"
    wait_for_fit(run_dir / FIT_LOG, search)
    search.send_signal(signal.SIGTERM)
    out, err = search.communicate(timeout=WAIT_S)
    assert search.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        "graphormer-urpe-hpopt: stopped by SIGTERM during trial 0 (its fit is stopped; the trial is marked "
        "failed and its values queued to run again): run the same command again to resume"), err[-3000:]
    assert "Traceback" not in err
    assert not processes_running(str(run_dir))  # the trial's fit ended with it
    stopped, queued = trials(tmp_path)
    assert stopped.state == optuna.trial.TrialState.FAIL
    assert queued.state == optuna.trial.TrialState.WAITING and queued.params == stopped.params

    resumed = run(command)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    stopped, rerun = trials(tmp_path)
    assert rerun.state == optuna.trial.TrialState.COMPLETE and rerun.params == stopped.params
    assert f"best: trial 1, val/mae {rerun.value:.6g}" in resumed.stdout

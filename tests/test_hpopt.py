"""graphormer-urpe-hpopt through the installed command on real ESOL (a tiny model, 4 steps a
trial): a search killed in its second trial and run again keeps its finished trial, fails and
re-runs the killed one, and writes best.yaml, which graphormer-urpe fit takes; each trial reports
its validations to the study and a pruned trial stops; bad input is one line, exit status 2,
before any trial."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest
import torch
import yaml

from graphormer_urpe.training.studies import search_trial as hpopt_trial
from graphormer_urpe.training.studies.search import BEST_CONFIG, DIVERGED_MARKER, FIT_LOG, PRUNED_MARKER, TRIAL_ENV
from graphormer_urpe.utils.torch_files import read_checkpoint

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TINY = json.dumps({"num_layers": 1, "hidden_dim": 16, "ffn_dim": 16, "num_heads": 2})
SPACE = {"model.lr": {"type": "float", "low": 1e-4, "high": 1e-3, "log": True},
         "model.backbone.dropout": {"type": "categorical", "choices": [0.0, 0.1]}}


def recipe(work: Path, esol: Path) -> list[str]:
    """The base recipe and the overrides every trial gets."""
    return ["--config", str(REPO / "configs" / "esol.yaml"), "--data.init_args.path", str(esol),
            "--data.init_args.cache_root", str(work / "cache"), "--data.init_args.encode_threads", "1",
            "--data.init_args.build_workers", "1", "--trainer.max_steps", "4",
            "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "2",
            "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
            "--model.backbone", TINY]


def write_space(path: Path, space: dict) -> Path:
    path.write_text(yaml.safe_dump(space))
    return path


def hpopt_command(work: Path, esol: Path, *extra: str, space: dict = SPACE) -> list[str]:
    return [str(BIN / "graphormer-urpe-hpopt"), "--space", str(write_space(work / "space.yaml", space)),
            "--runs-dir", str(work / "runs"), "--study", "esol", "--seed", "0", "--startup-trials", "1",
            *recipe(work, esol), *extra]


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=ENV, cwd=REPO)


def trials(work: Path) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name="esol", storage=f"sqlite:///{work / 'runs' / 'esol' / 'study.db'}").trials


@pytest.fixture(scope="module")
def searched(esol_csv, tmp_path_factory):
    """A 2-trial search killed (SIGKILL) during its second trial, then run again to the end."""
    work = tmp_path_factory.mktemp("hpopt")
    command = hpopt_command(work, esol_csv, "--n-trials", "2")
    search = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=REPO)
    line = ""  # a search that prints nothing: its stderr says why
    try:
        for line in search.stdout:
            if line.startswith("trial 0: "):
                break
        assert line.startswith("trial 0: complete"), line + search.stderr.read()[-3000:]
        second = work / "runs" / "esol" / "trial-1" / FIT_LOG
        deadline = time.monotonic() + 60
        while not (second.is_file() and "Seed set" in second.read_text()) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        search.kill()
        search.communicate()
    killed = trials(work)
    resumed = run(command)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    return SimpleNamespace(work=work, esol=esol_csv, killed=killed, resumed=resumed, final=trials(work))


def test_a_killed_search_keeps_its_finished_trials_and_reruns_the_killed_one(searched):
    states = [t.state for t in searched.killed]
    assert states == [optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.RUNNING]
    first, killed, rerun = searched.final
    assert (first.number, first.state, first.value, first.params) == (
        0, optuna.trial.TrialState.COMPLETE, searched.killed[0].value, searched.killed[0].params)
    assert killed.state == optuna.trial.TrialState.FAIL
    assert rerun.state == optuna.trial.TrialState.COMPLETE and rerun.params == killed.params
    assert "trial 1: its worker on this machine is gone" in searched.resumed.stdout
    # each trial is an ordinary fit in its run directory, its validations reported to the study
    for trial in (first, rerun):
        run_dir = searched.work / "runs" / "esol" / f"trial-{trial.number}"
        assert trial.user_attrs["run_dir"] == str(run_dir)
        assert (run_dir / "checkpoints" / "last.ckpt").is_file()
        assert sorted(trial.intermediate_values) == [0, 1]
        assert trial.value == min(trial.intermediate_values.values())


def test_best_yaml_is_the_best_trial_and_fit_takes_it(searched):
    best = min((t for t in searched.final if t.value is not None), key=lambda t: t.value)
    best_yaml = searched.work / "runs" / "esol" / BEST_CONFIG
    config = yaml.safe_load(best_yaml.read_text())
    assert config == {"model": {"lr": best.params["model.lr"],
                                "backbone": {"dropout": best.params["model.backbone.dropout"]}}}
    assert f"best: trial {best.number}," in searched.resumed.stdout
    run_dir = searched.work / "best_run"
    done = run([str(BIN / "graphormer-urpe"), "fit", *recipe(searched.work, searched.esol),
                "--config", str(best_yaml), "--trainer.default_root_dir", str(run_dir)])
    assert done.returncode == 0, done.stderr[-3000:]
    hparams = read_checkpoint(run_dir / "checkpoints" / "last.ckpt")["hyper_parameters"]
    assert hparams["lr"] == best.params["model.lr"]
    assert hparams["backbone"]["dropout"] == best.params["model.backbone.dropout"]


def refused(command: list[str], *, work: Path | None = None) -> str:
    done = run(command)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-3000:]
    assert lines[0].startswith("graphormer-urpe-hpopt: error: "), lines
    if work is not None:
        assert not (work / "runs").exists() or not list((work / "runs").rglob("trial-*"))
    return lines[0]


def test_refusals_are_one_line_before_any_trial(searched, esol_csv, tmp_path):
    line = refused(hpopt_command(tmp_path, esol_csv, "--n-trials", "1", space={
        "model.backbone.num_layerz": {"type": "int", "low": 1, "high": 2}}), work=tmp_path)
    assert "model.backbone.num_layerz" in line
    line = refused(hpopt_command(tmp_path, esol_csv, "--n-trials", "1", space={
        "model.lr": {"type": "float", "low": 1e-3, "high": 1e-4}}), work=tmp_path)
    assert "low must be below high" in line
    line = refused(hpopt_command(tmp_path, esol_csv, "--n-trials", "1",
                                 "--storage", f"sqlite:///{tmp_path}/no/such/dir/study.db"), work=tmp_path)
    assert "--storage" in line and "cannot open" in line
    # the searched study, run with another search space
    line = refused(hpopt_command(searched.work, esol_csv, "--n-trials", "3",
                                 space={"model.lr": SPACE["model.lr"]}))
    assert "another recipe" in line and "search space" in line
    assert len(trials(searched.work)) == len(searched.final)


def test_a_trial_reports_each_validation_and_the_pruner_stops_it(tmp_path, monkeypatch):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    study = optuna.create_study(study_name="prune", storage=storage)
    done = study.ask()
    done.report(0.1, 0)
    study.tell(done, 0.1)
    trial = study.ask()
    monkeypatch.setenv(TRIAL_ENV, json.dumps({
        "storage": storage, "study": "prune", "trial": trial.number, "monitor": "val/mae",
        "pruner": {"name": "median", "startup_trials": 1, "warmup_validations": 0}}))
    callback = hpopt_trial.ReportToTrial()
    trainer = SimpleNamespace(sanity_checking=False, is_global_zero=True, should_stop=False,
                              default_root_dir=str(tmp_path), callback_metrics={"val/mae": torch.tensor(5.0)})
    callback.on_validation_end(trainer, None)
    assert study.trials[1].intermediate_values == {0: 5.0}
    assert trainer.should_stop
    assert json.loads((tmp_path / PRUNED_MARKER).read_text()) == {"validation": 0, "val/mae": 5.0}
    assert not (tmp_path / DIVERGED_MARKER).exists()
    # a NaN metric: reported (the sampler ranks the trial last), and the run stops as diverged
    trainer.should_stop, trainer.callback_metrics = False, {"val/mae": torch.tensor(float("nan"))}
    callback.on_validation_end(trainer, None)
    assert math.isnan(study.trials[1].intermediate_values[1]) and trainer.should_stop
    assert json.loads((tmp_path / DIVERGED_MARKER).read_text()) == {
        "validation": 1, "reason": "val/mae is nan at validation 1; the run was stopped there"}

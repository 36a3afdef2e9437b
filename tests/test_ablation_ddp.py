"""The ablation's time budget on a run of 2 processes (``--trainer.devices 2 --trainer.strategy ddp``,
2 gloo processes on CPU, real ZINC-12k, tiny model): the runner's SIGTERM to its fit stops both
processes at one step, each invocation continues where the last stopped, and the run ends on
the parameters of the same 2-process fit run uninterrupted, bit for bit, with dropout on."""
from __future__ import annotations

import json
import os
import subprocess

import torch
from test_ablation import REPO, run_trials, runner_command, sliced_and_uninterrupted

from graphormer_urpe.training.studies.ablation_results import read_results


def test_a_two_process_run_stopped_by_the_time_budget_resumes_exactly(zinc_data_root, tmp_path):
    steps = 12
    stall = ["--trainer.callbacks+", json.dumps({"class_path": "slow_steps.StallOnce", "init_args": {
        "step": 5, "marker": str(tmp_path / "stalled"), "rank": 0}})]
    two = ["--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp"]
    command = runner_command(tmp_path, zinc_data_root, "--arms", "urpe", "--trainer.max_steps", str(steps),
                             "--model.total_steps", str(steps), *two, *stall, "--time-budget", "60s")
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests" / "helpers")])}
    for _ in range(6):
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        if read_results(tmp_path / "results.json"):
            break
    [entry] = read_results(tmp_path / "results.json")
    assert entry["steps"] == steps
    trials = [t for t in run_trials(tmp_path, "urpe") if "steps" in t.user_attrs]
    fits = [t.user_attrs["steps"] for t in trials]
    assert any(t.state.name == "FAIL" and t.user_attrs["steps"][1] == 5 for t in trials), fits
    assert [f[0] for f in fits[1:]] == [f[1] for f in fits[:-1]]

    sliced, whole = sliced_and_uninterrupted(tmp_path, trials[-1].user_attrs["args"], env)
    assert sliced["global_step"] == whole["global_step"] == steps
    assert len(sliced["process_rng_states"]) == 2
    for name, value in whole["state_dict"].items():
        assert torch.equal(sliced["state_dict"][name], value), name

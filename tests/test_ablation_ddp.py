"""The ablation's time slices on a run of 2 processes (``--trainer.devices 2 --trainer.strategy ddp``,
2 gloo processes on CPU, real ZINC-12k, tiny model): the runner's SIGTERM to its fit stops both
processes at one step, each slice continues where the last stopped, and the sliced run ends on
the parameters of the same 2-process fit run uninterrupted, bit for bit, with dropout on."""
from __future__ import annotations

import json
import os
import subprocess

import torch
from test_ablation import REPO, run_record, runner_command, sliced_and_uninterrupted

from graphormer_urpe.utils.files import read_json


def test_time_slices_of_a_two_process_run_resume_exactly(zinc_data_root, tmp_path):
    steps = 12
    stall = ["--trainer.callbacks+", json.dumps({"class_path": "slow_steps.StallOnce", "init_args": {
        "step": 5, "marker": str(tmp_path / "stalled"), "rank": 0}})]
    two = ["--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp"]
    command = runner_command(tmp_path, zinc_data_root, "--arms", "urpe", "--trainer.max_steps", str(steps),
                             "--model.total_steps", str(steps), *two, *stall, "--time-budget", "60s",
                             "--slice", "55s")
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests" / "helpers")])}
    for _ in range(6):
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        if read_json(tmp_path / "results.json", []):
            break
    [entry] = read_json(tmp_path / "results.json", [])
    assert entry["steps"] == steps
    fits = [a for a in run_record(tmp_path, "urpe")["attempts"] if a["stage"] == "fit"]
    assert any("slice_end" in a and a["steps"][1] == 5 for a in fits), fits
    assert [a["steps"][0] for a in fits[1:]] == [a["steps"][1] for a in fits[:-1]]

    sliced, whole = sliced_and_uninterrupted(tmp_path, run_record(tmp_path, "urpe"), env)
    assert sliced["global_step"] == whole["global_step"] == steps
    assert len(sliced["process_rng_states"]) == 2
    for name, value in whole["state_dict"].items():
        assert torch.equal(sliced["state_dict"][name], value), name

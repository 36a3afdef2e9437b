"""Several processes, gradient accumulation and fp16 through the one training step, on CPU, real
ZINC-12k, a tiny model, through the installed ``graphormer-urpe`` (2 gloo processes):

* 2 processes at batch 16 train what 1 process at batch 32 trains, and 1 process at batch 16
  accumulating 2 batches too, with the DataLoader and with the resident loader; a checkpoint of 2
  processes resumes on 1 and one of 1 on 2 (dropout off: within float32 rounding);
* a run stopped inside an epoch resumes only with its global batch (one line, before the data);
* validation metrics of 2 processes equal those of 1 (no graph counted twice), and the loss and
  metric of a validation or test split smaller than the processes, or shared out unevenly,
  are the split's own (ESOL);
* SIGTERM to one process of two stops both at one step, writes last.ckpt, exits 143 in one line,
  and the resumed run (dropout on, each process its own masks) equals the uninterrupted one bit
  for bit; Ctrl-C to the process group exits 130 in one line and leaves no process;
* fp16's loss scale (``16-mixed``) follows ``torch.amp.GradScaler``'s rule and resumes from the
  checkpoint."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from graphormer_urpe.training.engine import LossScale

REPO = Path(__file__).resolve().parents[2]
COMMAND = Path(sys.executable).with_name("graphormer-urpe")
TINY = {"attention": "urpe", "num_layers": 2, "hidden_dim": 16, "ffn_dim": 16, "num_heads": 2}
NO_DROPOUT = {"dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0}
DROPOUT = {"dropout": 0.1, "attention_dropout": 0.1, "activation_dropout": 0.1}
RESIDENT = ["--data.init_args.device_resident", "true", "--data.init_args.static_shapes", "true"]


def environment() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests" / "helpers")]),
            "OMP_NUM_THREADS": "1"}


def fit_args(run_dir: Path, data_root: Path, processes: int, batch: int, steps: int, *extra: str,
             backbone: dict = NO_DROPOUT) -> list[str]:
    ddp = ["--trainer.strategy", "ddp"] if processes > 1 else []
    return ["fit", "--config", str(REPO / "configs" / "zinc.yaml"),
            "--trainer.default_root_dir", str(run_dir), "--trainer.accelerator", "cpu",
            "--trainer.devices", str(processes), *ddp,
            "--trainer.precision", "32-true", "--trainer.max_steps", str(steps),
            "--trainer.limit_val_batches", "2", "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false", "--trainer.log_every_n_steps", "2",
            "--model.backbone", json.dumps({**TINY, **backbone}), "--model.warmup_steps", "4",
            "--model.total_steps", "100", "--data.init_args.root", str(data_root),
            "--data.init_args.max_hops", "5", "--data.init_args.batch_size", str(batch), *extra]


def graphormer_urpe(*args: str, expect: int = 0) -> subprocess.CompletedProcess:
    done = subprocess.run([str(COMMAND), *args], capture_output=True, text=True, timeout=900, env=environment())
    assert done.returncode == expect, done.stderr[-3000:]
    return done


def last(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)


def largest_difference(a: dict, b: dict) -> float:
    assert a["global_step"] == b["global_step"]
    return max((a["state_dict"][name] - value).abs().max().item() for name, value in b["state_dict"].items())


def processes_of(run_dir: Path) -> list[str]:
    """The processes still running a fit into ``run_dir``."""
    found = subprocess.run(["pgrep", "-f", f"default_root_dir {run_dir} "], capture_output=True, text=True)
    return found.stdout.split()


def stalled_fit(run_dir: Path, data_root: Path, steps: int, step: int, rank: int, *extra: str,
                backbone: dict = NO_DROPOUT) -> subprocess.Popen:
    """A 2-process fit into ``run_dir`` (a process group of its own), once process ``rank`` is
    held after step ``step`` (``slow_steps.StallOnce``, until a signal is held or 300 s)."""
    marker = run_dir.with_name(run_dir.name + ".stalled")
    stall = json.dumps({"class_path": "slow_steps.StallOnce",
                        "init_args": {"step": step, "marker": str(marker), "rank": rank}})
    process = subprocess.Popen([str(COMMAND), *fit_args(run_dir, data_root, 2, 16, steps, *extra,
                                                        "--trainer.callbacks+", stall, backbone=backbone)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env=environment(), start_new_session=True)
    deadline = time.monotonic() + 300
    while not marker.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return process


def test_two_processes_accumulation_and_resume_across_process_counts_train_one_model(zinc_data_root,
                                                                                      tmp_path, run_main):
    """Six updates of the global batch of 32 five ways: 1 process (batch 32) then 2 (batch 16)
    resumed from its step-3 checkpoint; 2 then 1; 1 process accumulating 2 batches of 16; the
    resident loader with 1 process and with 2. All end on the same weights (dropout off, within
    float32 rounding of a sum taken in another order); the resumed epochs continue at the same
    graph (a position off by one batch would differ by far more). Then the validation metrics
    of 2 processes equal those of 1, and a resume with another global batch is refused."""
    root = zinc_data_root
    one_then_two, two_then_one = tmp_path / "one_then_two", tmp_path / "two_then_one"
    graphormer_urpe(*fit_args(one_then_two, root, 1, 32, 3))
    graphormer_urpe(*fit_args(one_then_two, root, 2, 16, 6, "--ckpt_path", "last"))
    graphormer_urpe(*fit_args(two_then_one, root, 2, 16, 3))
    assert last(two_then_one)["data_position"] == {"global_batch": 32, "accumulate": 1}
    graphormer_urpe(*fit_args(two_then_one, root, 1, 32, 6, "--ckpt_path", "last"))
    graphormer_urpe(*fit_args(tmp_path / "accumulated", root, 1, 16, 6, "--trainer.accumulate_grad_batches", "2"))
    graphormer_urpe(*fit_args(tmp_path / "resident_one", root, 1, 32, 6, *RESIDENT))
    graphormer_urpe(*fit_args(tmp_path / "resident_two", root, 2, 16, 6, *RESIDENT))
    reference = last(one_then_two)
    assert reference["global_step"] == 6
    for run in ("two_then_one", "accumulated", "resident_one", "resident_two"):
        assert largest_difference(last(tmp_path / run), reference) < 1e-5, run
    assert last(tmp_path / "accumulated")["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["ready"] == 12

    def validate(processes: int) -> dict[str, float]:
        ddp = ["--trainer.strategy", "ddp"] if processes > 1 else []
        done = graphormer_urpe("validate", "--config", str(REPO / "configs" / "zinc.yaml"),
                               "--trainer.default_root_dir", str(tmp_path / f"validate{processes}"),
                               "--trainer.accelerator", "cpu", "--trainer.devices", str(processes), *ddp,
                               "--trainer.precision", "32-true", "--trainer.enable_progress_bar", "false",
                               "--data.init_args.root", str(root), "--data.init_args.max_hops", "5",
                               "--data.init_args.eval_batch_size", "48",  # 1,000 graphs: uneven shares
                               "--ckpt_path", str(one_then_two / "checkpoints" / "last.ckpt"))
        rows = [line.split() for line in done.stdout.splitlines() if line.strip().startswith("val/")]
        return {name: float(value) for name, value in rows}

    one, two = validate(1), validate(2)
    assert set(one) == {"val/loss", "val/mae"} and one == pytest.approx(two, rel=1e-6)

    from graphormer_urpe.cli.fit import main

    refused = run_main(main, fit_args(two_then_one, tmp_path / "empty", 1, 16, 9, "--ckpt_path", "last"))
    assert refused.returncode == 2 and refused.stderr.strip() == (
        f"graphormer-urpe: error: --ckpt_path {two_then_one / 'checkpoints' / 'last.ckpt'} stopped inside an "
        "epoch after 6 batches of a global batch of 32 graphs with accumulate_grad_batches 1; this run has 16 "
        "with 1: resume with the same global batch (processes x data.init_args.batch_size x "
        "trainer.accumulate_grad_batches) and accumulation")
    assert not (tmp_path / "empty").exists()


def test_sigterm_to_one_process_stops_both_at_one_step_and_the_run_resumes_exactly(zinc_data_root, tmp_path):
    """2 processes with dropout: SIGTERM to the second process while it is held after step 4
    (``slow_steps.StallOnce``): both stop at that step, last.ckpt holds it with each process's
    random state, the command exits 143 with one line and no process is left; resumed to step 8
    it equals the run that went to 8 at once, bit for bit (same graphs, same masks)."""
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    graphormer_urpe(*fit_args(straight, zinc_data_root, 2, 16, 8, backbone=DROPOUT))
    process = stalled_fit(stopped, zinc_data_root, 8, 4, 1, backbone=DROPOUT)
    ranks = processes_of(stopped)
    assert len(ranks) == 2, ranks
    os.kill(int(max(ranks, key=int)), signal.SIGTERM)  # the second process, started by the first
    assert process.wait(timeout=300) == 143
    stderr = process.stderr.read()
    said = [line for line in stderr.splitlines() if line.startswith("graphormer-urpe:")]
    assert "Traceback" not in stderr and said == [
        "graphormer-urpe: stopped by SIGTERM after the step in progress; a fit's checkpoints/last.ckpt holds "
        "that step (on every process): resume with --ckpt_path last"], stderr[-3000:]
    assert processes_of(stopped) == []
    held = last(stopped)
    assert held["global_step"] == 4
    first, second = held["process_rng_states"]
    assert torch.equal(first["torch"], held["rng_states"]["torch"]) and not torch.equal(first["torch"], second["torch"])

    graphormer_urpe(*fit_args(stopped, zinc_data_root, 2, 16, 8, "--ckpt_path", "last", backbone=DROPOUT))
    resumed, reference = last(stopped), last(straight)
    assert largest_difference(resumed, reference) == 0.0
    for index, state in reference["optimizer_states"][0]["state"].items():
        assert torch.equal(resumed["optimizer_states"][0]["state"][index]["exp_avg_sq"], state["exp_avg_sq"])


def test_ctrl_c_to_a_two_process_fit_exits_130_in_one_line_and_leaves_no_process(zinc_data_root, tmp_path):
    """Ctrl-C reaches every process of the terminal's group: the fit stops at one step's end on
    both, writes last.ckpt (it loads), says so once, exits 130, and no process is left."""
    run_dir = tmp_path / "run"
    process = stalled_fit(run_dir, zinc_data_root, 1000, 3, 0)
    os.killpg(process.pid, signal.SIGINT)
    assert process.wait(timeout=300) == 130
    stderr = process.stderr.read()
    said = [line for line in stderr.splitlines() if line.startswith("graphormer-urpe:")]
    assert "Traceback" not in stderr and len(said) == 1 and said[0].startswith(
        "graphormer-urpe: stopped by Ctrl-C (SIGINT) after the step in progress"), stderr[-3000:]
    assert last(run_dir)["global_step"] == 3
    assert processes_of(run_dir) == []


def test_a_killed_process_of_two_is_named_in_one_line(zinc_data_root, tmp_path):
    """The second process killed (SIGKILL, as the out-of-memory killer does) while the first waits
    for it in a step's all-reduce: the first names it in one line, exit status 1, no traceback
    (gloo's "Connection closed by peer"), no process left, and last.ckpt (every 2 steps) holds
    step 2 whole."""
    run_dir = tmp_path / "run"
    process = stalled_fit(run_dir, zinc_data_root, 1000, 3, 1, "--checkpoint.every_n_train_steps", "2")
    ranks = processes_of(run_dir)
    assert len(ranks) == 2, ranks
    second = max(ranks, key=int)  # started by the first
    os.kill(int(second), signal.SIGKILL)
    assert process.wait(timeout=300) == 1
    stderr = process.stderr.read()
    said = [line for line in stderr.splitlines() if line.startswith("graphormer-urpe:")]
    assert "Traceback" not in stderr and said == [
        f"graphormer-urpe: error: process 1 of 2 (pid {second}) ended with exit status -9 (killed by SIGKILL: "
        "out of memory?), so the fit stopped; resume it with --ckpt_path last"], stderr[-3000:]
    assert processes_of(run_dir) == []
    assert last(run_dir)["global_step"] == 2


@pytest.mark.parametrize("to", ["the process group", "the first process"])
def test_a_two_process_fit_stopped_while_its_data_is_built_says_so_in_one_line(zinc_source, tmp_path, to):
    """SIGTERM while the first process builds ZINC and the second waits for it in Lightning's
    barrier, to both (a scheduler, ``kill -- -PGID``) or to the first alone (``kill PID``): exit
    status 143 and the one line of a 1-process fit (not the barrier's traceback and exit 1), no
    process left, nothing half-built left in the data root."""
    from graphormer_urpe.data.zinc import ZINC_SOURCE_ENV
    from graphormer_urpe.utils.process import usable_cores
    from helpers.processes import children, group_is_gone

    if usable_cores() < 2:
        pytest.skip("the data is built without worker processes on one core")
    command = [str(COMMAND), "fit", "--config", "zinc", "--data.init_args.root", str(tmp_path / "data"),
               "--trainer.default_root_dir", str(tmp_path / "run"), "--trainer.max_steps", "4",
               "--model.warmup_steps", "1", "--trainer.accelerator", "cpu", "--trainer.devices", "2",
               "--trainer.strategy", "ddp"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               start_new_session=True, env={**environment(), ZINC_SOURCE_ENV: str(zinc_source)})
    deadline = time.monotonic() + 300
    while process.poll() is None and len(children(process.pid)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(children(process.pid)) == 3, "the second process and the build's two workers are not there"
    if to == "the process group":
        os.killpg(process.pid, signal.SIGTERM)
    else:
        process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == 143
    stderr = process.stderr.read()
    said = [line for line in stderr.splitlines() if line.startswith("graphormer-urpe:")]
    assert "Traceback" not in stderr and "monitoredBarrier" not in stderr and said == [
        "graphormer-urpe: stopped by SIGTERM while the data was built; what was half-built is removed: the same "
        "command builds it again"], stderr[-3000:]
    assert group_is_gone(process.pid)
    assert [p.name for p in (tmp_path / "data").rglob("*") if any(m in p.name for m in (".part", ".tmp-", ".stale-"))] == []


def test_loss_scale_follows_grad_scaler():
    """The device-side loss scale against ``torch.amp.GradScaler`` on the same sequence of
    overflowing and finite steps (growth after 3 good steps): the same scale after each; an
    update-free warmup step changes nothing."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    ours = LossScale.like(scaler, torch.device("cpu"))
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([param], lr=0.0)
    for overflow in [False, False, False, False, True, False, True, True, False, False, False, False]:
        optimizer.zero_grad()
        scaler.scale(param.sum()).backward()
        if overflow:
            param.grad.fill_(float("inf"))
        scaler.step(optimizer)
        scaler.update()
        ours.update(torch.tensor(overflow), torch.tensor(True))
        assert float(ours.scale) == scaler.get_scale()
    kept = ours.state_dict()
    ours.update(torch.tensor(True), torch.tensor(False))
    assert ours.state_dict() == kept


def test_sixteen_mixed_trains_with_the_loss_scale_and_resumes_it(zinc_data_root, tmp_path):
    """``16-mixed`` as a GPU runs it (fp16 autocast and a GradScaler), here on CPU: a first scale
    of 2**24 overflows, the update is skipped and counted as an overflow (not a divergence),
    the scale backs off until steps apply; the checkpoint holds the scale, and a resumed fit
    starts from it."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    from graphormer_urpe.data import ZINCDataModule
    from graphormer_urpe.data.facts import DataFacts
    from graphormer_urpe.training.module import GraphormerModule

    def run(steps: int, ckpt_path=None):
        dm = ZINCDataModule(root=str(zinc_data_root), batch_size=16, max_hops=5, device_resident=True,
                            static_shapes=True)
        pl.seed_everything(0, verbose=False)
        module = GraphormerModule(DataFacts.of(dm), backbone={**TINY, **NO_DROPOUT}, lr=1e-3, warmup_steps=2,
                                  total_steps=40)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=4)
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False,
                             plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
                             default_root_dir=tmp_path, limit_val_batches=0, num_sanity_val_steps=0,
                             enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1)
        trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
        return module, trainer

    module, trainer = run(12)
    engine = module._engine
    assert engine.total_skipped >= 1 and engine.total_applied >= 1
    assert engine.total_skipped + engine.total_applied == 12
    scale = float(engine.loss_scale.scale)
    assert scale < 2.0**24
    path = tmp_path / "sixteen.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, map_location="cpu", weights_only=True)["loss_scale"]
    assert saved["scale"] == scale
    resumed, _ = run(13, ckpt_path=str(path))
    assert resumed._engine.total_skipped == 0 and resumed._engine.total_applied == 1


def test_lightnings_accumulation_scheduler_accumulates_in_the_step(zinc_data_root):
    """``GradientAccumulationScheduler`` (3 batches an update from epoch 0): 4 updates take 12
    batches, and AdamW counts 4 steps, as the trainer does."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    from graphormer_urpe.data import ZINCDataModule
    from graphormer_urpe.data.facts import DataFacts
    from graphormer_urpe.training.module import GraphormerModule

    dm = ZINCDataModule(root=str(zinc_data_root), batch_size=16, max_hops=5)
    pl.seed_everything(0, verbose=False)
    module = GraphormerModule(DataFacts.of(dm), backbone={**TINY, **NO_DROPOUT}, lr=1e-3, warmup_steps=2,
                              total_steps=40)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
                         callbacks=[GradientAccumulationScheduler({0: 3})], limit_val_batches=0,
                         num_sanity_val_steps=0, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, datamodule=dm)
    assert trainer.global_step == 4
    assert trainer.fit_loop.epoch_loop.batch_progress.current.ready == 12
    steps = {float(state["step"]) for state in trainer.optimizers[0].state.values()}
    assert steps == {4.0}


def test_ddp_on_one_device_trains(zinc_data_root, tmp_path):
    """``--trainer.strategy ddp`` with one process (DDP's wrapper, a process group of one) trains
    through the step as without it."""
    graphormer_urpe(*fit_args(tmp_path / "run", zinc_data_root, 1, 16, 3, "--trainer.strategy", "ddp"))
    assert last(tmp_path / "run")["global_step"] == 3


def test_a_signal_inside_an_accumulation_cycle_stops_at_its_update(zinc_data_root, tmp_path):
    """Accumulating 2 batches an update, SIGTERM held while the 7th batch (the first of update 4's
    cycle) ends: the fit stops after that cycle's update (step 4, 8 batches), never between its
    batches, and resumed to 6 it equals the run that went to 6 at once, bit for bit."""
    accumulate = ["--trainer.accumulate_grad_batches", "2"]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    graphormer_urpe(*fit_args(straight, zinc_data_root, 1, 16, 6, *accumulate, backbone=DROPOUT))
    stall = json.dumps({"class_path": "slow_steps.StallOnce", "init_args": {"batch": 6, "marker": str(tmp_path / "s")}})
    process = subprocess.Popen([str(COMMAND), *fit_args(stopped, zinc_data_root, 1, 16, 6, *accumulate,
                                                        "--trainer.callbacks+", stall, backbone=DROPOUT)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=environment())
    deadline = time.monotonic() + 300
    while not (tmp_path / "s").exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=300) == 143, process.stderr.read()[-3000:]
    held = last(stopped)
    assert held["global_step"] == 4
    assert held["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["ready"] == 8
    graphormer_urpe(*fit_args(stopped, zinc_data_root, 1, 16, 6, *accumulate, "--ckpt_path", "last",
                              backbone=DROPOUT))
    assert largest_difference(last(stopped), last(straight)) == 0.0


def test_a_checkpoint_inside_an_accumulation_cycle_resumes_exactly(zinc_data_root, tmp_path):
    """2 processes with dropout accumulating 3 batches an update, validated every 4 batches: the
    validation after batch 8 (2 batches into the cycle of update 3) writes a best checkpoint,
    which holds each process's summed gradients; resumed from it to step 4 the run equals the
    uninterrupted one bit for bit (weights and AdamW moments: its update 3 has the gradients of
    the cycle's first two batches too)."""
    every_validation = ["--trainer.accumulate_grad_batches", "3", "--trainer.val_check_interval", "4",
                        "--trainer.check_val_every_n_epoch", "1", "--checkpoint.save_top_k", "-1"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    graphormer_urpe(*fit_args(straight, zinc_data_root, 2, 16, 4, *every_validation, backbone=DROPOUT))
    inside, = (straight / "checkpoints").glob("epoch=0-step=2-*.ckpt")
    held = torch.load(inside, map_location="cpu", weights_only=True)
    assert held["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["ready"] == 8
    assert len(held["accumulated_gradients"]) == 2
    graphormer_urpe(*fit_args(resumed, zinc_data_root, 2, 16, 4, *every_validation, "--ckpt_path", str(inside),
                              backbone=DROPOUT))
    reference = last(straight)
    assert "accumulated_gradients" not in reference  # written at the cycle's update
    assert largest_difference(last(resumed), reference) == 0.0
    for index, state in reference["optimizer_states"][0]["state"].items():
        assert torch.equal(last(resumed)["optimizer_states"][0]["state"][index]["exp_avg"], state["exp_avg"])


def csv_args(command: str, run_dir: Path, table: Path, splits: Path, processes: int, *extra: str) -> list[str]:
    """``command`` (fit, validate, test) on the rows of ``table`` that ``splits`` names, through
    the ESOL recipe with a tiny model."""
    ddp = ["--trainer.strategy", "ddp"] if processes > 1 else []
    return [command, "--config", str(REPO / "configs" / "esol.yaml"), "--trainer.default_root_dir", str(run_dir),
            "--trainer.accelerator", "cpu", "--trainer.devices", str(processes), *ddp,
            "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
            "--model.backbone", json.dumps({**TINY, **NO_DROPOUT}), "--data.init_args.path", str(table),
            "--data.init_args.split_file", str(splits), "--data.init_args.cache_root", str(run_dir.parent / "cache"),
            "--data.init_args.batch_size", "8", *extra]


def results(stdout: str, stage: str) -> dict[str, float]:
    """The metrics of Lightning's table of results (``val/loss 1.23``, ...)."""
    rows = [line.split() for line in stdout.splitlines() if line.strip().startswith(f"{stage}/")]
    return {name: float(value) for name, value in rows}


def test_evaluation_on_two_processes_is_the_splits_own(esol_csv, tmp_path, run_main):
    """A validation split of one ESOL molecule, fewer than the 2 processes (Lightning's sampler
    stopped the fit with an AssertionError), and a test split of three, shared out 2 and 1 (the
    loss was the mean of each process's mean, 1.5 times the split's): the 2-process fit
    validates, and its checkpoint gives the split's own loss and metric on 2 processes as on 1."""
    import csv

    import pandas as pd

    from graphormer_urpe.cli.fit import main

    table = tmp_path / "esol40.csv"
    pd.read_csv(esol_csv).head(40).to_csv(table, index=False)
    splits = tmp_path / "splits.json"
    splits.write_text(json.dumps({"train": list(range(32)), "val": [32], "test": [33, 34, 35]}))
    run_dir = tmp_path / "fit"
    graphormer_urpe(*csv_args("fit", run_dir, table, splits, 2, "--trainer.max_steps", "2",
                              "--model.warmup_steps", "1", "--trainer.log_every_n_steps", "1"))
    with open(next(run_dir.rglob("metrics.csv"))) as f:
        logged = [row for row in csv.DictReader(f) if row.get("val/loss")]
    assert len(logged) == 1  # after the epoch of 2 global batches: the checkpoint's weights
    checkpoint = str(run_dir / "checkpoints" / "last.ckpt")

    one = run_main(main, csv_args("validate", tmp_path / "validate1", table, splits, 1, "--ckpt_path", checkpoint))
    assert one.returncode == 0, one.stderr[-3000:]
    assert results(one.stdout, "val") == pytest.approx(
        {"val/loss": float(logged[-1]["val/loss"]), "val/mae": float(logged[-1]["val/mae"])}, rel=1e-6)

    one = run_main(main, csv_args("test", tmp_path / "test1", table, splits, 1, "--ckpt_path", checkpoint))
    assert one.returncode == 0, one.stderr[-3000:]
    two = graphormer_urpe(*csv_args("test", tmp_path / "test2", table, splits, 2, "--ckpt_path", checkpoint))
    assert set(results(one.stdout, "test")) == {"test/loss", "test/mae"}
    assert results(two.stdout, "test") == pytest.approx(results(one.stdout, "test"), rel=1e-6)


def test_a_two_process_test_ends_with_its_process_group_closed(esol_csv, tmp_path):
    """``graphormer-urpe test`` on 2 gloo processes (as the ablation runs it) closes its process
    group before it exits: left to the interpreter's exit, gloo's threads could be torn down under
    it, and the process aborted after printing its metrics ("terminate called ...", exit -6)."""
    import pandas as pd

    table = tmp_path / "esol40.csv"
    pd.read_csv(esol_csv).head(40).to_csv(table, index=False)
    splits = tmp_path / "splits.json"
    splits.write_text(json.dumps({"train": list(range(32)), "val": [32], "test": [33, 34, 35]}))
    done = graphormer_urpe(*csv_args("test", tmp_path / "test2", table, splits, 2))
    assert set(results(done.stdout, "test")) == {"test/loss", "test/mae"}
    assert "terminate called" not in done.stderr, done.stderr[-3000:]

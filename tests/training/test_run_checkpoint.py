"""Checkpoints and resume through the installed ``graphormer-urpe`` on the real ZINC-12k (tiny
model, epochs of 3 batches): ``last.ckpt`` holds the final step of every fit, a run directory
with checkpoints is never silently reused, ``--ckpt_path last`` says what it resumes, and a
resumed run with dropout equals the uninterrupted one bit for bit."""
from __future__ import annotations

import hashlib
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_cli import TINY_BACKBONE, zinc_args

from graphormer_urpe.cli.fit import main as cli_main

REPO = Path(__file__).resolve().parents[2]
COMMAND = Path(sys.executable).with_name("graphormer-urpe")
DROPOUT = {"dropout": 0.1, "attention_dropout": 0.1, "activation_dropout": 0.1}


def graphormer_urpe(*args: str) -> subprocess.CompletedProcess:
    assert COMMAND.is_file(), f"{COMMAND} is not installed (pip install -e .)"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run([str(COMMAND), *args], capture_output=True, text=True, timeout=600, env=env)


def fit(run_dir: Path, data_root: Path, *extra: str, expect: int = 0) -> subprocess.CompletedProcess:
    done = graphormer_urpe("fit", *zinc_args(run_dir, data_root, *extra))
    assert done.returncode == expect, done.stderr[-3000:]
    return done


def error_line(done: subprocess.CompletedProcess) -> str:
    """The one error line of a refused command (no traceback)."""
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("graphormer-urpe: error: ")]
    assert len(lines) == 1, done.stderr[-3000:]
    return lines[0]


def refused_fit(run_main, run_dir: Path, data_root: Path, *extra: str) -> str:
    """The one error line of ``graphormer-urpe fit`` refused with exit status 2, run in this
    process (a refusal before any training needs no process start of its own)."""
    done = run_main(cli_main, ["fit", *zinc_args(run_dir, data_root, *extra)])
    assert done.returncode == 2, done.stderr[-3000:]
    return error_line(done)


def last_step(run_dir: Path) -> int:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu",
                      weights_only=False)["global_step"]


def folder(run_dir: Path) -> dict[str, str]:
    """Every file of the checkpoint folder (hidden ones too) and its SHA-256."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((run_dir / "checkpoints").iterdir())}


def assert_one_last_ckpt(run_dir: Path) -> None:
    """``last.ckpt`` and no ``last-v1.ckpt``, no temporary file left, nothing but checkpoints."""
    names = set(folder(run_dir))
    assert "last.ckpt" in names and not any(n.startswith("last-") for n in names), names
    assert all(n.endswith(".ckpt") and not n.startswith(".") for n in names), names


def test_last_ckpt_holds_the_final_step_after_the_last_validation(zinc_data_root, tmp_path):
    """max_epochs 3, validated every 2 epochs (at step 6): last.ckpt holds step 9, not 6.
    (A stop by max_steps inside an epoch: the dropout test below.) Then a resumed fit whose
    checkpoint writes fail (a file size limit below a checkpoint's size, EFBIG as on a full
    disk) stops and leaves every checkpoint byte for byte, and no temporary file."""
    run_dir = tmp_path / "run"
    epochs = ["--trainer.max_steps", "-1", "--trainer.check_val_every_n_epoch", "2"]
    fit(run_dir, zinc_data_root, "--trainer.max_epochs", "3", *epochs)
    assert last_step(run_dir) == 9
    assert_one_last_ckpt(run_dir)
    assert any(n.startswith("epoch=1-step=6-") for n in folder(run_dir))  # the best validation one

    before = folder(run_dir)
    limit = (run_dir / "checkpoints" / "last.ckpt").stat().st_size // 2
    failed = subprocess.run(
        [str(COMMAND), "fit", *zinc_args(run_dir, zinc_data_root, "--trainer.max_epochs", "5", *epochs,
                                         "--ckpt_path", "last")],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)},
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    assert failed.returncode != 0 and "File too large" in failed.stderr, failed.stderr[-3000:]
    assert folder(run_dir) == before


def test_a_run_directory_with_checkpoints_is_resumed_or_overwritten_never_reused(zinc_data_root,
                                                                                tmp_path, run_main):
    """``--ckpt_path last`` into an empty folder starts from scratch and says so in one line; a
    fit without ``--ckpt_path`` into a folder with checkpoints is refused in one line (exit 2)
    naming the three ways on; ``--ckpt_path last`` where the folder has checkpoints but no
    last.ckpt is refused; ``--checkpoint.overwrite true`` starts over; test reads last.ckpt. The
    refusals leave every file byte for byte."""
    run_dir, checkpoints = tmp_path / "run", tmp_path / "run" / "checkpoints"
    started = fit(run_dir, zinc_data_root, "--trainer.max_steps", "3", "--ckpt_path", "last")
    notes = [line for line in started.stderr.splitlines() if "--ckpt_path last" in line]
    assert notes == [f"--ckpt_path last: no checkpoint in {checkpoints}; training from scratch"], \
        started.stderr[-3000:]
    assert last_step(run_dir) == 3
    before = folder(run_dir)

    line = refused_fit(run_main, run_dir, zinc_data_root, "--trainer.max_steps", "6")
    assert f"{checkpoints} already holds checkpoints" in line, line
    for way in ("--ckpt_path last", "--trainer.default_root_dir", "--checkpoint.overwrite true"):
        assert way in line, line
    assert folder(run_dir) == before

    (checkpoints / "last.ckpt").rename(tmp_path / "last.ckpt")
    line = refused_fit(run_main, run_dir, zinc_data_root, "--trainer.max_steps", "6", "--ckpt_path", "last")
    assert f"--ckpt_path last: {checkpoints} has no last.ckpt but holds epoch=0-step=3-" in line, line
    (tmp_path / "last.ckpt").rename(checkpoints / "last.ckpt")
    assert folder(run_dir) == before

    fit(run_dir, zinc_data_root, "--trainer.max_steps", "2", "--checkpoint.overwrite", "true")
    assert last_step(run_dir) == 2
    assert set(folder(run_dir)) == {"last.ckpt"}  # the earlier run's checkpoints are gone

    tested = graphormer_urpe("test", *zinc_args(run_dir, zinc_data_root, "--ckpt_path", "last"))
    assert tested.returncode == 0, tested.stderr[-3000:]
    assert f"Restoring states from the checkpoint path at {checkpoints / 'last.ckpt'}" \
        in tested.stderr + tested.stdout


def test_a_resumed_run_with_dropout_equals_the_uninterrupted_one_bit_for_bit(zinc_data_root, tmp_path):
    """Dropout 0.1 everywhere, epochs of 4 batches, validation every 3 steps: stopped at step 5
    (inside epoch 1, after a validation), resumed to 8 (across a validation inside the epoch and
    the epoch's end), it ends with the weights and AdamW state of the run that went to 8 at once:
    same data order and same dropout masks; both keep ``model.total_steps``, and the resume says
    nothing about the schedule."""
    common = ["--model.backbone", json.dumps({**TINY_BACKBONE, **DROPOUT}), "--trainer.limit_train_batches", "4",
              "--trainer.val_check_interval", "3", "--trainer.check_val_every_n_epoch", "null"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    fit(straight, zinc_data_root, *common, "--trainer.max_steps", "8")
    fit(resumed, zinc_data_root, *common, "--trainer.max_steps", "5")
    assert last_step(resumed) == 5  # stopped by max_steps inside epoch 1, after the validation at 3
    kept = fit(resumed, zinc_data_root, *common, "--trainer.max_steps", "8", "--ckpt_path", "last")
    assert "another learning-rate schedule" not in kept.stderr
    assert_one_last_ckpt(resumed)
    load = lambda run: torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    reference, result = load(straight), load(resumed)
    assert result["global_step"] == reference["global_step"] == 8
    for name, value in reference["state_dict"].items():
        assert torch.equal(result["state_dict"][name], value), name
    for index, state in reference["optimizer_states"][0]["state"].items():
        assert torch.equal(result["optimizer_states"][0]["state"][index]["exp_avg"], state["exp_avg"])
    assert torch.equal(result["rng_states"]["torch"], reference["rng_states"]["torch"])


def test_a_fit_stopped_by_max_steps_inside_a_long_epoch_resumes_bit_for_bit(zinc_data_root, tmp_path):
    """Whole epochs of the recipe's ZINC (625 batches of 16, the ordinary DataLoader), dropout on, no
    validation before the stop: 3 steps then ``--ckpt_path last`` to 6 equal 6 steps at once, bit
    for bit, and Lightning's warning about loaders that cannot resume is not shown (they do)."""
    common = ["--model.backbone", json.dumps({**TINY_BACKBONE, **DROPOUT}), "--trainer.limit_train_batches", "1.0",
              "--trainer.check_val_every_n_epoch", "10", "--model.total_steps", "100"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    fit(straight, zinc_data_root, *common, "--trainer.max_steps", "6")
    fit(resumed, zinc_data_root, *common, "--trainer.max_steps", "3")
    held = torch.load(resumed / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert held["global_step"] == 3 and held["epoch"] == 0  # inside epoch 0, not marked complete
    kept = fit(resumed, zinc_data_root, *common, "--trainer.max_steps", "6", "--ckpt_path", "last")
    assert "dataloader is not resumable" not in kept.stderr
    load = lambda run: torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    reference, result = load(straight), load(resumed)
    assert result["global_step"] == reference["global_step"] == 6
    for name, value in reference["state_dict"].items():
        assert torch.equal(result["state_dict"][name], value), name


def test_a_resume_that_changes_the_schedule_says_so(zinc_data_root, tmp_path):
    """Validating every 3 steps, without ``model.total_steps``: each fit's schedule ends at its
    own ``max_steps``, so 3 steps then ``--ckpt_path last`` to 6 decayed the first 3 steps faster
    than 6 steps at once; the resumed fit says so in one warning instead of silently ending
    elsewhere (a resume that keeps the schedule is exact:
    :func:`test_a_resumed_run_with_dropout_equals_the_uninterrupted_one_bit_for_bit`)."""
    other_schedule = ["--model.backbone", json.dumps({**TINY_BACKBONE, **DROPOUT}), "--model.warmup_steps", "2",
                      "--model.total_steps", "null", "--trainer.val_check_interval", "3",
                      "--trainer.check_val_every_n_epoch", "null", "--trainer.limit_train_batches", "1.0"]
    fit(tmp_path / "other", zinc_data_root, *other_schedule, "--trainer.max_steps", "3")
    changed = fit(tmp_path / "other", zinc_data_root, *other_schedule, "--trainer.max_steps", "6",
                  "--ckpt_path", "last")
    assert ("resuming with another learning-rate schedule (warmup 2, total 6 steps) than the checkpoint "
            "was trained with (warmup 2, total 3 steps)") in changed.stderr


@pytest.mark.parametrize("name", ["SIGTERM", "SIGHUP"])
def test_a_fit_stopped_by_a_signal_keeps_its_last_step_in_last_ckpt(zinc_data_root, tmp_path, name):
    """``kill`` (SIGTERM) or a closed terminal (SIGHUP, which ended the process on the spot) in
    the middle of a fit that never validated: the step in progress ends, last.ckpt holds it, the
    command says so in one line with exit status 128 + the signal, and ``--ckpt_path last``
    continues from that step."""
    import signal
    import time

    signum = getattr(signal, name)

    run_dir = tmp_path / "run"
    long_fit = ["--trainer.limit_train_batches", "1.0", "--trainer.max_epochs", "-1",
                "--trainer.max_steps", "100000", "--model.total_steps", "100000",
                "--trainer.check_val_every_n_epoch", "1000"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([str(COMMAND), "fit", *zinc_args(run_dir, zinc_data_root, *long_fit)],
                               stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    metrics = run_dir / "csv" / "version_0" / "metrics.csv"
    deadline = time.monotonic() + 300
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) > 1):  # it has trained
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()[1][-3000:]
        time.sleep(0.2)
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 128 + signum, stderr[-3000:]
    assert "Traceback" not in stderr
    assert f"graphormer-urpe: stopped by {name} after the step in progress" in stderr
    stopped = last_step(run_dir)
    assert stopped > 0
    assert_one_last_ckpt(run_dir)
    assert set(folder(run_dir)) == {"last.ckpt"}  # it never validated: no other checkpoint

    fit(run_dir, zinc_data_root, *long_fit[:-4], "--trainer.max_steps", str(stopped + 2),
        "--model.total_steps", "100000", "--trainer.check_val_every_n_epoch", "1000", "--ckpt_path", "last")
    assert last_step(run_dir) == stopped + 2


def test_a_sigterm_during_a_validation_is_held_to_the_next_step_end(zinc_data_root, tmp_path, monkeypatch):
    """A SIGTERM that arrives after a step's checkpoint hook (here: in the validation after step
    3) is held back: the validation ends, step 4 runs, and last.ckpt holds it when the fit stops.
    Lightning alone would stop inside the validation with no last.ckpt at all."""
    import signal

    from graphormer_urpe.training.lightning_cli import build_cli
    from graphormer_urpe.training.module import GraphormerModule

    validate = GraphormerModule.validation_step

    def signal_then_validate(self, batch, batch_idx=0):
        if self.trainer.global_step == 3 and batch_idx == 0 and not self.trainer.sanity_checking:
            os.kill(os.getpid(), signal.SIGTERM)
        return validate(self, batch, batch_idx)

    monkeypatch.setattr(GraphormerModule, "validation_step", signal_then_validate)
    handler = signal.getsignal(signal.SIGTERM)
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit):  # Lightning's SIGTERMException
        build_cli(["fit", *zinc_args(run_dir, zinc_data_root, "--trainer.max_steps", "20")])
    assert last_step(run_dir) == 4
    assert signal.getsignal(signal.SIGTERM) == handler  # the fit gave the signal back

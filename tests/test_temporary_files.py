"""Temporary files are removed on every exit path: a cache build that runs out of disk space,
and ``graphormer-urpe-predict`` stopped by SIGTERM, SIGHUP or Ctrl-C or losing its worker process
(a previous output stays as it was, no process is left); ``graphormer-urpe fit`` stopped by
Ctrl-C exits with 130, without a traceback; a full disk behind another error is one line."""
from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import graphormer_urpe.data.array_store as store
from graphormer_urpe.cli.fit import main as cli_main
from graphormer_urpe.data.zinc import ZINC_SOURCE_ENV
from helpers.processes import children, group_is_gone

REPO = Path(__file__).resolve().parents[1]
PREDICT = Path(sys.executable).with_name("graphormer-urpe-predict")
TINY = json.dumps({"num_layers": 1, "hidden_dim": 16, "ffn_dim": 16, "num_heads": 2})


def esol_fit(work: Path, csv: Path) -> list[str]:
    return ["fit", "--config", str(REPO / "configs" / "esol.yaml"),
            "--trainer.default_root_dir", str(work / "run"), "--trainer.max_steps", "2",
            "--trainer.limit_val_batches", "1", "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false", "--model.backbone", TINY,
            "--model.warmup_steps", "1", "--data.init_args.path", str(csv),
            "--data.init_args.cache_root", str(work / "cache"), "--data.init_args.build_workers", "1"]


class _FullDisk(io.FileIO):
    """A file on a disk with ``room`` bytes left (shared by every file opened through it):
    writes beyond fail with ENOSPC, as does the flush when a buffered file is closed."""

    room = 0

    def write(self, data) -> int:
        if len(data) > _FullDisk.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.name)
        _FullDisk.room -= len(data)
        return super().write(data)


def _open_on_full_disk(file, mode="r", *args, **kwargs):
    if not any(c in mode for c in "wa+"):
        return open(file, mode, *args, **kwargs)
    raw = _FullDisk(file, mode.replace("b", "").replace("t", ""))
    buffered = io.BufferedRandom(raw) if "+" in mode else io.BufferedWriter(raw)
    return buffered if "b" in mode else io.TextIOWrapper(buffered, encoding=kwargs.get("encoding"))


def test_full_disk_during_a_cache_build_leaves_no_temporary_directory(esol_csv, tmp_path,
                                                                      monkeypatch, capsys):
    """The featurized ESOL entry is built on a full disk (the bytes still buffered fail again
    when the files are closed): the command says so in one line, exit status 1, and leaves
    neither a ``.tmp-`` directory nor an entry."""
    _FullDisk.room = 0
    monkeypatch.setattr(store, "open", _open_on_full_disk, raising=False)
    status = cli_main(esol_fit(tmp_path, esol_csv))
    assert status == 1
    assert "graphormer-urpe: error: [Errno 28] No space left on device" in capsys.readouterr().err
    left = [p.name for p in (tmp_path / "cache").rglob("*") if ".tmp-" in p.name]
    assert left == []
    assert not list((tmp_path / "cache").rglob("manifest.json"))


@pytest.fixture(scope="module")
def esol_checkpoint(esol_csv, tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("esol_model")
    assert cli_main(esol_fit(work, esol_csv)) == 0
    return work / "run" / "checkpoints" / "last.ckpt"


def _start_long_prediction(checkpoint: Path, esol_csv: Path, tmp_path: Path) -> tuple[subprocess.Popen, Path, str]:
    """ESOL's molecules 100 times through one worker process, in a process group of its own,
    over a previous output; returns once the first predictions are in the ``.part`` file:
    (the process, the output, the previous output's SHA-256)."""
    smiles = pd.read_csv(esol_csv)["smiles"].tolist() * 100
    source = tmp_path / "in.smi"
    source.write_text("\n".join(smiles) + "\n")
    output = tmp_path / "out.csv"
    output.write_text("row,smiles,prediction,error\n1,CCO,-0.5,\n")  # a previous run's output
    before = hashlib.sha256(output.read_bytes()).hexdigest()
    assert PREDICT.is_file(), f"{PREDICT} is not installed (pip install -e .)"
    process = subprocess.Popen([str(PREDICT), "--ckpt", str(checkpoint), "--input", str(source),
                                "--output", str(output), "--workers", "1", "--quiet"],
                               stderr=subprocess.PIPE, text=True, start_new_session=True,
                               env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.monotonic() + 180

    def predictions_written() -> bool:  # the first chunk's rows reached the .part file
        return any(p.stat().st_size > 0 for p in tmp_path.glob(".out.csv.*.part"))

    while not predictions_written() and time.monotonic() < deadline:
        assert process.poll() is None, process.stderr.read()
        time.sleep(0.05)
    assert predictions_written(), "no predictions reached a .part file"
    assert process.poll() is None, "the prediction finished before the signal"
    return process, output, before


def _ended(process: subprocess.Popen, seconds: float) -> int:
    """The exit status; a process still running after ``seconds`` (a stop that hangs) is killed
    with its whole group, and the test fails."""
    try:
        return process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail(f"still running {seconds} s after the signal: {process.args}")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_predict_stopped_by_a_signal_removes_its_part_file(esol_checkpoint, esol_csv,
                                                           tmp_path, signum):
    """A long prediction (ESOL's molecules 100 times, a worker process) is stopped once its
    first predictions are in the ``.part`` file, by a signal to its whole process group (as
    Ctrl-C, a closed terminal, ``timeout`` or a scheduler sends it): it exits with 128 + the
    signal (130 for Ctrl-C) and one line naming the signal, no traceback from it or its worker,
    no process of it left, the ``.part`` file is gone, the previous output unchanged. (A worker
    that died of the signal while it held a lock of ``multiprocessing.Pool``'s queues made the
    parent wait for ever, on a busy CPU.)"""
    process, output, before = _start_long_prediction(esol_checkpoint, esol_csv, tmp_path)
    os.killpg(process.pid, signum)
    assert _ended(process, 60) == 128 + signum
    stderr = process.stderr.read()
    assert "Traceback" not in stderr, stderr[-3000:]
    said = ("Ctrl-C (SIGINT)" if signum == signal.SIGINT else signal.Signals(signum).name)
    assert stderr.strip().splitlines() == [
        f"graphormer-urpe-predict: stopped by {said}; outputs not yet written are left as they were"]
    assert group_is_gone(process.pid), "a worker process outlived the command"
    assert list(tmp_path.glob("*.part")) == [] and list(tmp_path.glob(".*.part")) == []
    assert hashlib.sha256(output.read_bytes()).hexdigest() == before


def test_predict_whose_worker_is_killed_says_so_and_keeps_the_previous_output(esol_checkpoint, esol_csv,
                                                                              tmp_path):
    """The worker process alone is killed (SIGKILL, as the out-of-memory killer does) while the
    prediction streams: the command says so in one line naming the worker's exit status, exits
    with 1 (it waited for ever for the lost chunk with ``multiprocessing.Pool``), the ``.part``
    file is gone and the previous output unchanged."""
    process, output, before = _start_long_prediction(esol_checkpoint, esol_csv, tmp_path)
    children = Path(f"/proc/{process.pid}/task/{process.pid}/children")
    if not children.exists():
        pytest.skip("the kernel does not list a process's children (/proc/PID/task/PID/children)")
    [worker] = map(int, children.read_text().split())
    os.kill(worker, signal.SIGKILL)
    assert _ended(process, 60) == 1
    stderr = process.stderr.read()
    assert "Traceback" not in stderr, stderr[-3000:]
    assert stderr.strip().splitlines() == [
        f"graphormer-urpe-predict: error: a worker process (pid {worker}) ended with exit status -9 "
        "(killed by SIGKILL) before returning its chunk (out of memory?); nothing written"]
    assert group_is_gone(process.pid)
    assert list(tmp_path.glob("*.part")) == [] and list(tmp_path.glob(".*.part")) == []
    assert hashlib.sha256(output.read_bytes()).hexdigest() == before


def _fit_building_zinc(zinc_source: Path, tmp_path: Path) -> subprocess.Popen:
    """``graphormer-urpe fit --config zinc`` (its own process group), once its worker processes
    build ZINC from its SMILES."""
    from graphormer_urpe.utils.process import usable_cores

    if usable_cores() < 2:
        pytest.skip("the data is built without worker processes on one core")
    command = [str(Path(sys.executable).with_name("graphormer-urpe")), "fit", "--config", "zinc",
               "--data.init_args.root", str(tmp_path / "data"), "--trainer.default_root_dir",
               str(tmp_path / "run"), "--trainer.max_steps", "4", "--model.warmup_steps", "1"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               start_new_session=True, env={**os.environ, ZINC_SOURCE_ENV: str(zinc_source)})
    deadline = time.monotonic() + 300
    while process.poll() is None and len(children(process.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(children(process.pid)) == 2, "the data was not being built"
    return process


def test_fit_whose_data_build_worker_is_killed_says_so_in_one_line(zinc_source, tmp_path):
    """One worker process of the data build is killed (SIGKILL, as the out-of-memory killer
    does): one line naming the worker's exit status, exit status 1, no traceback, no process left
    (``multiprocessing.Pool`` waited for ever for the lost chunk)."""
    process = _fit_building_zinc(zinc_source, tmp_path)
    worker = children(process.pid)[0]
    os.kill(worker, signal.SIGKILL)
    assert _ended(process, 120) == 1
    stderr = process.stderr.read()
    assert "Traceback" not in stderr, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == (
        f"graphormer-urpe: error: a worker process (pid {worker}) ended with exit status -9 "
        "(killed by SIGKILL) before returning its chunk (out of memory?)")
    assert group_is_gone(process.pid)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_fit_stopped_while_the_data_is_built_removes_what_was_half_built(zinc_source, tmp_path, signum):
    """SIGTERM or SIGHUP to the fit while its workers build ZINC (before Lightning's own handlers
    are in place, when the process died on the spot): one line, exit status 128 + the signal,
    no worker left, no temporary file or folder (``.part``, ``.tmp-``, ``.stale-``) left in the
    data root."""
    process = _fit_building_zinc(zinc_source, tmp_path)
    process.send_signal(signum)
    assert _ended(process, 120) == 128 + signum
    stderr = process.stderr.read()
    assert "Traceback" not in stderr, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == (
        f"graphormer-urpe: stopped by {signal.Signals(signum).name} while the data was built; what was "
        "half-built is removed: the same command builds it again")
    assert group_is_gone(process.pid)
    left = [p.name for p in (tmp_path / "data").rglob("*") if any(m in p.name for m in (".part", ".tmp-", ".stale-"))]
    assert left == []


def test_a_build_killed_by_sigkill_leaves_a_folder_the_next_build_removes(zinc_source, tmp_path, monkeypatch):
    """A fit killed with SIGKILL (with its workers) while it builds ZINC leaves its ``.raw.tmp-``
    folder; the next build of the raw files removes it, and keeps the one that another build,
    still running, holds."""
    from graphormer_urpe.data import zinc

    raw = tmp_path / "data" / "ZINC" / "raw"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\n"
                               "from graphormer_urpe.utils.files import AtomicDirectory\n"
                               "building = AtomicDirectory(sys.argv[1])\nprint(building.tmp, flush=True)\ntime.sleep(600)", str(raw)],
                              stdout=subprocess.PIPE, text=True)
    try:
        held = Path(holder.stdout.readline().strip())
        process = _fit_building_zinc(zinc_source, tmp_path)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=60)
        assert group_is_gone(process.pid)
        killed = [p for p in raw.parent.glob(".raw.tmp-*") if p != held]
        assert len(killed) == 1 and held.is_dir()
        # the next build (the SMILES' graphs stood in for: only the folders matter here)
        monkeypatch.setattr(zinc, "zinc_graphs_from_smiles", lambda smiles, *a, **k: [
            (np.zeros(1, np.uint8), np.zeros((1, 1), np.uint8)) for _ in smiles])
        zinc.build_zinc_raw(raw, zinc_source)
        assert list(raw.parent.glob(".raw.tmp-*")) == [held]
        assert sorted(p.name for p in raw.iterdir()) == sorted(zinc._RAW_FILES)
    finally:
        holder.kill()
        holder.wait()


def test_a_hangup_ignored_at_start_stays_ignored():
    """A command started with SIGHUP ignored (``nohup``) keeps it ignored wherever a command takes
    the stop signals (a command's stop and the ablation's grid, a data build's, a fit's held
    signals), while SIGTERM is still taken; the handlers are given back after each."""
    from graphormer_urpe.training.run_checkpoint import RunCheckpoint
    from graphormer_urpe.utils.process import stop_on_signals

    before = signal.signal(signal.SIGHUP, signal.SIG_IGN), signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        for takes in (stop_on_signals, lambda: stop_on_signals(unless_handled=True)):
            with takes():
                assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
                assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN)
                os.kill(os.getpid(), signal.SIGHUP)  # nothing happens
            assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        checkpoint = RunCheckpoint()
        checkpoint._hold_signals()
        try:
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) == checkpoint._hold_signal
        finally:
            checkpoint._release_signals()
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGHUP, before[0])
        signal.signal(signal.SIGTERM, before[1])


def test_fit_stopped_by_ctrl_c_exits_130_without_a_traceback(esol_csv, tmp_path):
    """``graphormer-urpe fit --config configs/csv.yaml`` (ESOL) gets SIGINT in its process group
    once training has written a checkpoint: exit status 130 (Lightning's own is 1), one line and
    no traceback, and the checkpoint on disk loads."""
    import torch

    command = [str(Path(sys.executable).with_name("graphormer-urpe")), "fit", "--config",
               str(REPO / "configs" / "csv.yaml"), "--trainer.default_root_dir", str(tmp_path / "run"),
               "--trainer.max_steps", "1000", "--trainer.val_check_interval", "2",
               "--trainer.limit_val_batches", "1", "--trainer.enable_progress_bar", "false",
               "--trainer.enable_model_summary", "false", "--data.init_args.path", str(esol_csv),
               "--data.init_args.cache_root", str(tmp_path / "cache")]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                               start_new_session=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    deadline = time.monotonic() + 300
    while not last.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert last.exists() and process.poll() is None, process.stderr.read()[-3000:]
    os.killpg(process.pid, signal.SIGINT)
    assert process.wait(timeout=120) == 130
    stderr = process.stderr.read()
    assert "Traceback" not in stderr and stderr.strip().splitlines()[-1].startswith(
        "graphormer-urpe: stopped by Ctrl-C (SIGINT)"), stderr[-3000:]
    assert torch.load(last, map_location="cpu", weights_only=True)["global_step"] >= 2


def test_outputs_committed_together_are_all_put_back_when_one_rename_fails(tmp_path):
    """``files.commit_together``: the first output is renamed into place, the second's rename
    fails (a directory now stands at its path): the first output's previous file is put back
    byte for byte, a new third one that was never renamed does not appear, and no temporary or
    kept link is left."""
    from graphormer_urpe.utils.files import AtomicFile, commit_together

    table, vectors, atoms = tmp_path / "table.csv", tmp_path / "vectors.npy", tmp_path / "atoms.npz"
    table.write_text("the previous table\n")
    outputs = [AtomicFile(table), AtomicFile(vectors, binary=True), AtomicFile(atoms, binary=True)]
    outputs[0].handle.write("a new table\n")
    outputs[1].handle.write(b"new vectors")
    outputs[2].handle.write(b"new atoms")
    vectors.mkdir()
    (vectors / "in the way").write_text("")
    with pytest.raises(OSError):
        commit_together(outputs)
    for output in outputs:
        output.discard()
    assert table.read_text() == "the previous table\n" and not atoms.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["table.csv", "vectors.npy"]

    vectors.joinpath("in the way").unlink()
    vectors.rmdir()
    outputs = [AtomicFile(table), AtomicFile(vectors, binary=True)]
    outputs[0].handle.write("a new table\n")
    outputs[1].handle.write(b"new vectors")
    commit_together(outputs)
    assert table.read_text() == "a new table\n" and vectors.read_bytes() == b"new vectors"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["table.csv", "vectors.npy"]


def test_a_full_disk_under_another_error_is_one_line(capsys):
    """``run_command`` finds a full disk behind the error raised while handling it (torch's
    writer raises ``RuntimeError: unexpected pos`` over the ``OSError``): one line, exit 1."""
    from graphormer_urpe.utils.process import run_command

    def work() -> int:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64") from None

    assert run_command("prog", work) == 1
    assert capsys.readouterr().err == ("prog: error: [Errno 28] No space left on device; outputs not yet "
                                       "written are left as they were\n")
    with pytest.raises(RuntimeError, match="not a full disk"):
        run_command("prog", lambda: (_ for _ in ()).throw(RuntimeError("not a full disk")))


def test_ctrl_c_made_an_exit_by_lightning_is_one_line_and_an_exit_chosen_is_kept(capsys):
    """``run_command``: the ``sys.exit(1)`` Lightning's loops raise while handling Ctrl-C is the
    Ctrl-C line and 130; an exit status the work raises itself, even while handling Ctrl-C, is
    left as it is."""
    from graphormer_urpe.utils.process import INTERRUPTED, run_command

    def stopped(chosen: bool) -> int:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            if chosen:
                raise SystemExit(130) from None
            sys.exit(1)

    assert run_command("prog", lambda: stopped(False)) == INTERRUPTED
    assert capsys.readouterr().err == "prog: stopped by Ctrl-C (SIGINT); outputs not yet written are left as they were\n"
    with pytest.raises(SystemExit) as exit:
        run_command("prog", lambda: stopped(True))
    assert exit.value.code == 130 and capsys.readouterr().err == ""
